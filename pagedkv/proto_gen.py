"""Regenerate the Python stubs from proto/*.proto (run: python -m pagedkv.proto_gen [OUT_DIR])."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto under proto/ into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pagedkv.proto_gen", description=__doc__)
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT,
                        help="where the pagedkv/api and pagedkv/executor stubs go (default: this checkout)")
    generate(parser.parse_args().out_dir)
