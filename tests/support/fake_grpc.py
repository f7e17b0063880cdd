"""A stand-in for grpc's ServicerContext, for calling the API servicer in-process: its abort raises Aborted."""

from __future__ import annotations


class Aborted(Exception):
    def __init__(self, code, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return "test"

    async def abort(self, code, details: str):
        raise Aborted(code, details)
