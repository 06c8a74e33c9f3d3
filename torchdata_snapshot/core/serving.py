"""``ServingLoop``: what the worker loop and the dispatching loop have in common.

Each serves the requests of the process that drives it: one table per loop maps a request type
to the name of its handler (``HANDLERS``; a subclass extends its base's table, and overriding a
handler is overriding the method). A request without a handler, or a handler that fails, is
answered with ``ErrorResponse`` carrying the exception, and the loop keeps serving. Pause,
resume, limit and terminate mean the same in both loops (DataLoader2's semantics: ``pause()`` the
DataPipes that run threads of their own, apply the user's ``pause_fn``/``resume_fn``/
``limit_fn`` to the graph); see NOTE [ Snapshot protocol ] in :mod:`torchdata_snapshot.core.messages`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Type

from torchdata.dataloader2.graph import DataPipe

from torchdata_snapshot._errors import ExceptionWrapper, ProtocolError
from torchdata_snapshot.core.graph import pausable, pause_datapipe
from torchdata_snapshot.core.messages import (
    ErrorResponse,
    LimitRequest,
    LimitResponse,
    PauseRequest,
    PauseResponse,
    Request,
    Response,
    ResumeRequest,
    ResumeResponse,
    TerminateRequest,
    TerminateResponse,
)
from torchdata_snapshot.core.transport.channel import ParentGone

__all__ = ["ServingLoop"]


class ServingLoop:
    """Base of the worker and dispatching loops: the request table and the shared handlers.

    Subclasses set ``datapipe`` (the graph they run), ``name`` (how errors name the process) and
    implement :meth:`_reply` (how an answer is sent) and :meth:`_datapipes` (the graph's
    DataPipes, for pausing).
    """

    #: Request type -> name of the method that handles it.
    HANDLERS: ClassVar[Dict[Type[Request], str]] = {
        PauseRequest: "_on_pause",
        ResumeRequest: "_on_resume",
        LimitRequest: "_on_limit",
        TerminateRequest: "_on_terminate",
    }

    datapipe: DataPipe
    name: str
    iterator: Optional[Any] = None
    paused = False
    terminated = False

    def _reply(self, response: Response) -> None:
        raise NotImplementedError

    def _datapipes(self) -> List[DataPipe]:
        raise NotImplementedError

    def _handle(self, request: Request) -> None:
        """Serve one request; a failure is answered, never raised (unless the parent is gone)."""
        handler = self.HANDLERS.get(type(request))
        try:
            if handler is None:
                name = type(request).__name__
                raise ProtocolError(f"{self.name} does not handle request {name!r} ({request!r})")
            getattr(self, handler)(request)
        except ParentGone:
            raise
        except Exception:
            where = f"in {self.name} while serving {type(request).__name__}"
            self._reply(ErrorResponse(type(request).__name__, ExceptionWrapper(where=where)))

    # --- the handlers both loops share ----------------------------------------------------------

    def _on_pause(self, request: PauseRequest) -> None:
        for dp in pausable(self._datapipes()):
            pause_datapipe(dp)
        if request.pause_fn is not None:
            self.datapipe = request.pause_fn(self.datapipe)
        self.paused = True
        self._reply(self._pause_response())

    def _pause_response(self) -> PauseResponse:
        return PauseResponse()

    def _on_resume(self, request: ResumeRequest) -> None:
        if request.resume_fn is not None:
            self.datapipe = request.resume_fn(self.datapipe)
        for dp in reversed(pausable(self._datapipes())):
            dp.resume()
        self.paused = False
        self._reply(ResumeResponse())

    def _on_limit(self, request: LimitRequest) -> None:
        """DataLoader2's limit: ``limit_fn(graph, n)``, ``n`` being this worker's share if it has one."""
        if request.limit_fn is not None:
            share = request.num_batches if request.worker_num_batches is None else request.worker_num_batches
            self.datapipe = request.limit_fn(self.datapipe, share)
        self._reply(LimitResponse())

    def _on_terminate(self, request: TerminateRequest) -> None:
        self.terminated = True
        self.iterator = None
        self._reply(TerminateResponse())
