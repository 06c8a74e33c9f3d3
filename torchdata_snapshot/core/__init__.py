"""The core: messages, transport, the worker loop, the main process's consumer and the reading service."""
