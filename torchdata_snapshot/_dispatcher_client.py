"""``DispatcherClient``: the main process's control link to the dispatching process.

The main process drives the dispatching process as it drives workers (see
:mod:`torchdata_snapshot._links`), through one channel: a request, then its answer within the
control timeout. An exchange that does not complete leaves the client ``broken``.
"""

from __future__ import annotations

from typing import Optional, Type, TypeVar

from torchdata_snapshot._channel import Channel
from torchdata_snapshot._errors import ProtocolError
from torchdata_snapshot._messages import ErrorResponse, Request, Response, TerminateRequest, TerminateResponse

__all__ = ["DispatcherClient"]

R = TypeVar("R", bound=Response)


class DispatcherClient:
    """Asks the dispatching process one request at a time."""

    def __init__(self, channel: Channel, control_timeout_s: float) -> None:
        self.channel = channel
        self.control_timeout_s = control_timeout_s
        self.broken: Optional[str] = None  # why its answers can no longer be trusted

    def ask(self, request: Request, expected: Type[R]) -> R:
        """Send ``request`` and return the answer; an ``ErrorResponse`` is raised as its error."""
        try:
            self.channel.send(request)
            response = self.channel.recv(self.control_timeout_s, what=expected.__name__)
        except BaseException as e:
            self.broken = f"{type(e).__name__} during {expected.__name__}"
            raise
        if isinstance(response, ErrorResponse):
            response.exc.reraise()
        if not isinstance(response, expected):
            raise ProtocolError(
                f"the dispatching process answered {type(response).__name__}, not {expected.__name__}"
            )
        return response

    def say_goodbye(self) -> bool:
        """Ask the dispatching process to stop; whether it said goodbye (if not, the caller kills it)."""
        if self.broken is not None:
            return False
        try:
            self.ask(TerminateRequest(), TerminateResponse)
        except Exception:
            return False
        return True

    def close(self) -> None:
        self.channel.close()
