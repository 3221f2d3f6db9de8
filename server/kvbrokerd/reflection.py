"""Server reflection that keeps the .proto comments, so that `grpcurl describe` documents every RPC and field.

The Python descriptor pool drops `source_code_info`; the reflection servicer serialises files with `CopyToProto`.
So the pool handed to it returns files that copy themselves from the checked-in descriptor set (built with
`--include_source_info` by proto/generate.py) when they are ours.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

import kvbroker.v1

DESCRIPTOR_SET = Path(kvbroker.v1.__file__).parent / "descriptors.binpb"


class _CommentedFile:
    def __init__(self, file: Any, raw: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
        self._file = file
        self._raw = raw
        self.name: str = file.name

    @property
    def dependencies(self) -> list[_CommentedFile]:
        return [_CommentedFile(d, self._raw) for d in self._file.dependencies]

    def CopyToProto(self, proto: descriptor_pb2.FileDescriptorProto) -> None:
        if self.name in self._raw:
            proto.CopyFrom(self._raw[self.name])
        else:
            self._file.CopyToProto(proto)


class CommentedPool:
    """A DescriptorPool facade for grpc_reflection: our files with comments, the rest as the pool has them."""

    def __init__(self) -> None:
        files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes()).file
        self._raw = {f.name: f for f in files}
        self._pool = descriptor_pool.DescriptorPool()
        # error_details: so that grpcurl decodes the google.rpc.ErrorInfo in every error's details.
        for module in (health_pb2, reflection_pb2, error_details_pb2):
            self._add_with_dependencies(module.DESCRIPTOR)
        for proto in files:
            self._pool.Add(proto)

    def _add_with_dependencies(self, file: Any) -> None:
        try:
            self._pool.FindFileByName(file.name)
            return
        except KeyError:
            pass
        for dependency in file.dependencies:
            self._add_with_dependencies(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        self._pool.Add(proto)

    def FindFileByName(self, name: str) -> _CommentedFile:
        return _CommentedFile(self._pool.FindFileByName(name), self._raw)

    def FindFileContainingSymbol(self, symbol: str) -> _CommentedFile:
        return _CommentedFile(self._pool.FindFileContainingSymbol(symbol), self._raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


@functools.cache
def commented_pool() -> CommentedPool:
    return CommentedPool()
