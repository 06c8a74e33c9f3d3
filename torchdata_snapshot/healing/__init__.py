"""Self-healing (optional): a worker that dies is replaced and replays its stream."""
