"""Real formats, made on the fly (no downloads): text shards and WebDataset-style image shards,
and the pipelines that read them as users do (files listed, shuffled and sharded, then opened
and parsed). Files are written once per size into the temporary directory and reused."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import zlib
from typing import Any, Dict, List

import numpy as np
import torch
from torchdata.datapipes.iter import FileLister

TEXT_FILES = 40
IMAGE_SHARDS = 16
IMAGE_SIDE = 64
VOCABULARY = 50_000


def _directory(kind: str, records: int) -> str:
    root = os.path.join(tempfile.gettempdir(), f"dataloader2-bench-{kind}-{records}")
    os.makedirs(root, exist_ok=True)
    return root


def _write_once(path: str, data: bytes) -> None:
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


def text_shards(lines: int) -> str:
    """``TEXT_FILES`` text files holding ``lines`` lines of 12 words in all."""
    root = _directory("text", lines)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(2_000)]
    for f in range(TEXT_FILES):
        count = lines // TEXT_FILES + (f < lines % TEXT_FILES)
        picks = rng.integers(0, len(words), (count, 12))
        text = "".join(" ".join(words[w] for w in row) + "\n" for row in picks)
        _write_once(os.path.join(root, f"part{f:03d}.txt"), text.encode())
    return root


def image_shards(images: int) -> str:
    """``IMAGE_SHARDS`` tar files holding ``images`` JPEGs (``IMAGE_SIDE`` pixels square, written
    with Pillow) with a class label each, WebDataset-style (``key.jpg``, ``key.cls``)."""
    from PIL import Image

    root = _directory("images", images)
    rng = np.random.default_rng(0)
    for shard in range(IMAGE_SHARDS):
        path = os.path.join(root, f"shard{shard:03d}.tar")
        if os.path.exists(path):
            continue
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for i in range(shard, images, IMAGE_SHARDS):
                pixels = rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
                jpeg = io.BytesIO()
                Image.fromarray(pixels).save(jpeg, "JPEG", quality=90)
                for suffix, data in ((".jpg", jpeg.getvalue()), (".cls", str(i % 1000).encode())):
                    info = tarfile.TarInfo(f"sample{i:08d}{suffix}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        _write_once(path, buffer.getvalue())
    return root


def tokenize(line: str) -> List[int]:
    """Words to ids (a stable hash: the same ids in every process)."""
    return [zlib.crc32(word.encode()) % VOCABULARY for word in line.split()]


def decode(sample: Dict[str, Any]) -> Any:
    """A WebDataset sample to ``(image tensor CHW uint8, label)``."""
    from PIL import Image

    image = np.asarray(Image.open(sample[".jpg"]).convert("RGB"))
    return torch.from_numpy(image).permute(2, 0, 1).contiguous(), int(sample[".cls"].read())


def text_pipeline(lines: int) -> Any:
    """text files -> shuffle -> sharding_filter -> open -> readlines -> tokenize -> batch(16)."""
    files = FileLister(text_shards(lines), masks="*.txt").shuffle().sharding_filter()
    return files.open_files().readlines(return_path=False).map(tokenize).batch(16)


def image_pipeline(images: int) -> Any:
    """tar shards -> shuffle -> sharding_filter -> open -> load_from_tar -> webdataset ->
    decode JPEG -> batch(8)."""
    files = FileLister(image_shards(images), masks="*.tar").shuffle().sharding_filter()
    return files.open_files("b").load_from_tar().webdataset().map(decode).batch(8)
