"""Compiles ``proto/*.proto`` into ``autodist/proto/*_pb2.py`` (and ``*_pb2_grpc.py``).

Sources that declare a gRPC ``service`` also get a ``<name>_pb2_grpc.py``
module with the client stub and the servicer base class.

The generated modules are checked in; run this script from anywhere after
editing a ``.proto`` file::

    python scripts/gen_protos.py

``tests/test_protos_in_sync.py`` fails when the checked-in modules are stale.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
from typing import List, Optional

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
# The .proto files import each other as "autodist/proto/<name>.proto", so the
# source directory is mapped onto that virtual path for protoc.
VIRTUAL_PROTO_PATH = "autodist/proto"
GRPC_FLOOR = "1.85.0"  # setup.py's grpcio floor
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_SERVICE = re.compile(r"^\s*service\s+\w+\s*\{", re.MULTILINE)


def proto_sources(proto_dir: pathlib.Path = PROTO_DIR) -> List[pathlib.Path]:
    """Lists the ``.proto`` files to compile.

    Args:
        proto_dir: directory holding the ``.proto`` sources.

    Returns:
        list[pathlib.Path]: the sources, sorted by name.

    Raises:
        FileNotFoundError: if ``proto_dir`` holds no ``.proto`` file.
    """
    sources = sorted(proto_dir.glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"No .proto files found in proto_dir={str(proto_dir)!r}.")
    return sources


def declares_service(source: pathlib.Path) -> bool:
    """Tells whether a ``.proto`` file declares a gRPC service.

    Args:
        source: the ``.proto`` file.

    Returns:
        bool: True if a ``service`` block appears outside comments.
    """
    return bool(_SERVICE.search(_COMMENT.sub("", source.read_text())))


def module_names(proto_dir: pathlib.Path = PROTO_DIR) -> List[str]:
    """Lists the file names of the modules :func:`generate` writes.

    Args:
        proto_dir: directory holding the ``.proto`` sources.

    Returns:
        list[str]: ``<name>_pb2.py`` for every source, plus
        ``<name>_pb2_grpc.py`` for those declaring a service, sorted.
    """
    names = []
    for source in proto_sources(proto_dir):
        names.append(source.stem + "_pb2.py")
        if declares_service(source):
            names.append(source.stem + "_pb2_grpc.py")
    return sorted(names)


def _run_protoc(args: List[str]) -> None:
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed with exit code {result.returncode} for arguments "
                           f"{args!r}: {result.stderr.strip()}")


def generate(out_dir: pathlib.Path = REPO_ROOT,
             proto_dir: pathlib.Path = PROTO_DIR) -> List[pathlib.Path]:
    """Runs protoc on every source, writing ``<out_dir>/autodist/proto/*_pb2*.py``.

    Args:
        out_dir: root the generated package path is written under; the repo
            root for the checked-in files, a temporary directory for checks.
        proto_dir: directory holding the ``.proto`` sources.

    Returns:
        list[pathlib.Path]: the generated files, named as :func:`module_names`.

    Raises:
        RuntimeError: if protoc reports an error.
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = proto_sources(proto_dir)
    # With a virtual mapping protoc expects the sources by their virtual names.
    virtual = [f"{VIRTUAL_PROTO_PATH}/{p.name}" for p in sources]
    with_service = [f"{VIRTUAL_PROTO_PATH}/{p.name}" for p in sources if declares_service(p)]
    # protoc runs in a child process: loading grpc_tools' bundled compiler into
    # a process that already imported TensorFlow crashes (both link protobuf).
    # grpc_tools.protoc adds the well-known-types include path itself.
    base = [sys.executable, "-m", "grpc_tools.protoc", f"-I{VIRTUAL_PROTO_PATH}={proto_dir}"]
    _run_protoc([*base, f"--python_out={out_dir}", *virtual])
    # Stubs only for sources with a service: protoc would otherwise write an
    # import-only *_pb2_grpc.py for every message file.
    if with_service:
        _run_protoc([*base, f"--grpc_python_out={out_dir}", *with_service])
    gen_dir = out_dir / VIRTUAL_PROTO_PATH
    for stub in gen_dir.glob("*_pb2_grpc.py"):
        _pin_grpc_version(stub)
    return [gen_dir / name for name in module_names(proto_dir)]


def _pin_grpc_version(stub: pathlib.Path) -> None:
    """Writes ``GRPC_FLOOR`` as the stub's generated version: the stub asks grpcio for at
    least that version, and the checked-in modules do not change with grpcio-tools'
    patch releases (``tests/test_protos_in_sync.py`` regenerates them with whatever
    is installed)."""
    text, count = re.subn(r"^GRPC_GENERATED_VERSION = '[^']*'$",
                          f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", stub.read_text(),
                          flags=re.MULTILINE)
    if count != 1:
        raise RuntimeError(f"{stub} has no GRPC_GENERATED_VERSION line to pin")
    stub.write_text(text)


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        int: the process exit code.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", type=pathlib.Path, default=REPO_ROOT,
                        help="root directory to write autodist/proto/*_pb2*.py under")
    args = parser.parse_args(argv)
    for path in generate(args.out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
