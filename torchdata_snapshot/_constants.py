"""The package's time bounds, sizes and sentinel values, in one place.

Every blocking wait of this package has a bound from here (see NOTE [ Snapshot protocol ] in
:mod:`torchdata_snapshot.core.messages`): a waiter wakes up at least every
``LIVENESS_CHECK_INTERVAL_S`` to check the other side, and gives up after the bound of what it
waits for. Options of the reading service (``control_timeout_s``, ``timeout_s``) override the
defaults named ``DEFAULT_*``.
"""

from __future__ import annotations

# --- waits ----------------------------------------------------------------------------------

#: How long a blocked wait sleeps in ``poll`` before it checks that the other side is alive.
LIVENESS_CHECK_INTERVAL_S = 1.0

#: A process that has not answered yet may still be starting (with ``spawn``: a new interpreter
#: imports torch and unpickles its graph): its first answer gets at least this long, whatever
#: the caller's timeout. Liveness is checked all along: a process that dies is reported at once.
STARTUP_TIMEOUT_S = 120.0

#: A control wait bounds a stuck process, not a slow one: a process that used at least this share
#: of the bound in CPU time since the wait began (or was last extended) gets the bound again.
#: A process blocked on a lock or a read uses next to none; its own idle threads, well under 1%.
BUSY_CPU_FRACTION = 0.05

#: How long to wait for a process that closed its pipe to report its exit code.
EXIT_CODE_WAIT_S = 2.0

#: Default bound on waiting for the answer to a control request (pause, state, reset, ...).
#: A worker answers between two items, so this must exceed the time to produce one item.
DEFAULT_CONTROL_TIMEOUT_S = 120.0

#: How long shutdown waits for each process to say goodbye and exit before killing it (capped
#: by the control timeout).
JOIN_TIMEOUT_S = 10.0

#: At interpreter exit, a pool nobody shut down gets this long to say goodbye before it is killed:
#: whatever the workers still had to send is of no use to anyone.
EXIT_JOIN_TIMEOUT_S = 1.0

#: How long shutdown waits for another thread's exchange with the workers before it kills them.
TERMINATE_LOCK_WAIT_S = 1.0

#: How long a worker's outbox thread gets to write what is queued when the worker exits.
OUTBOX_CLOSE_TIMEOUT_S = 10.0

#: During a long replay, a worker tells the main process it is alive this often.
REPLAY_HEARTBEAT_S = 1.0

#: A long replay's progress is logged (at INFO) at most this often, the first time this long
#: after it started: a replay shorter than this logs only its result.
REPLAY_PROGRESS_LOG_S = 5.0

# --- pacing ---------------------------------------------------------------------------------

#: While producing, a worker looks for requests after this many items or seconds, whichever
#: comes first: requests are answered between items without a syscall per item.
REQUEST_CHECK_ITEMS = 64
REQUEST_CHECK_S = 0.002

#: Small items (see ``core.transport.batches.small_items_window``): the credit window of a worker whose items
#: travel whole in their pickles covers at least this many of their bytes, up to that many items.
SMALL_ITEMS_PREFETCH_BYTES = 1 << 18
SMALL_ITEMS_MAX_WINDOW = 512

#: Stateful restore: by default, at most this many items between two captures of a graph's state.
DEFAULT_MAX_ITEMS_BETWEEN_CAPTURES = 1024

#: Stateful restore: the share of a worker's production time that capturing its graph's state
#: may take.
CAPTURE_TIME_BUDGET = 0.01

#: ``num_workers=0`` with isolated global RNGs and ``read_ahead=True``: at most this many items,
#: or this much time (at least one item), are produced ahead within one swap of the RNG states
#: (about 25 us).
READ_AHEAD_ITEMS = 256
READ_AHEAD_S = 0.002
#: ... and at most this many bytes of tensors and arrays (cheap large items would otherwise hold
#: hundreds of megabytes, and fresh memory for every one of them costs page faults).
READ_AHEAD_BYTES = 16 << 20

#: How often a pause rechecks torchdata's ``Prefetcher``'s ``paused`` flag while its thread lives
#: (the thread sets a flag and signals nothing else; ``Prefetcher.pause()`` rechecks every 10 ms).
PREFETCHER_PAUSE_CHECK_S = 0.001

#: The tensor pool (on by default where the platform has it): the most a slot, which holds the
#: tensors of one item, may grow to (``tensor_pool_slot_bytes``), and the size it starts at
#: (see NOTE [ Tensor pool ] in the tensor pool's module, "Sizes").
TENSOR_POOL_SLOT_BYTES = 64 << 20
TENSOR_POOL_START_SLOT_BYTES = 1 << 20

#: Offsets of tensors inside a tensor pool slot are multiples of this (a cache line; every
#: dtype's alignment), and a slot is at least this large.
ALIGN_BYTES = 64

# --- the dispatching process ----------------------------------------------------------------

#: Credit a worker grants the dispatcher: dispatched items it may hold unread.
DISPATCH_WINDOW = 32

#: Items the dispatcher may hold for one worker that does not ask for them. Round-robin means
#: that feeding a hungry worker produces items for all the others; a pipeline whose workers
#: consume very unevenly (a filter after the dispatch) would otherwise grow without bound.
MAX_PENDING_PER_WORKER = 10_000

# --- the checkpoint -------------------------------------------------------------------------

#: A DataPipe's constructor argument longer than this as JSON (a list of thousands of file names)
#: is data rather than a setting: the checkpoint does not record it (see ``datapipe_arguments``),
#: and its size stays that of the pipeline's settings.
ARGUMENT_MAX_CHARS = 256

# --- sentinel values ------------------------------------------------------------------------

#: The epoch number before the first epoch starts.
NO_EPOCH = -1

#: The epoch number of a consumer that was shut down: whatever is still in flight is stale.
CLOSED_EPOCH = -2

#: The ``worker_id`` of the dispatching process in a :class:`~torchdata_snapshot.WorkerSnapshot`.
DISPATCHER_ID = -1
