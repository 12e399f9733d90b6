"""Files written whole or not at all: a temp file in the same folder, fsync, then ``os.replace``.

A crash or an error while writing leaves the old file (or none), never half of a new one. The new
file gets the permissions an ordinary ``open(path, "w")`` would give (0666 less the umask), not
``mkstemp``'s private 0600, so a calibration written in a checkout can be shipped and read by others.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; the folder is made when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
