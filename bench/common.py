"""What the benchmarks share: JSON lines, process memory, texts to stream, common arguments."""

import argparse
import importlib.util
import io
import json
import os
import resource
import sys
from pydoc_data import topics

import numpy as np
from PIL import Image

from engine import POLICIES


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def status_bytes(pid: int, name: str, default: int | None = None) -> int:
    """A field of /proc/<pid>/status in bytes (VmRSS: resident now; VmHWM: its peak; RssFile...);
    `default` where it has none (None: KeyError)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    if default is None:
        raise KeyError(name)
    return default


def rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def frame_jpeg(index: int) -> bytes:
    """A 320x240 JPEG frame, its colour and a white bar's place changing with `index`."""
    image = np.zeros((240, 320, 3), np.uint8)
    image[:] = ((index * 37) % 256, (index * 91) % 256, 128)
    image[:, (index * 13) % 300 : (index * 13) % 300 + 20] = 255
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


def english_text() -> str:
    """Python's own documentation topics: about 113k SmolLM2 tokens of real English (and code)."""
    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


PROSE = ("pydoc", "idle", "licenses")  # besides a path to any UTF-8 text file
IDLE_TEXTS = ("NEWS.txt", "NEWS2x.txt", "HISTORY.txt", "README.txt")  # IDLE's change notes and guide
LICENSES = "/usr/share/common-licenses"  # Debian's (base-files): every machine of this project has them


def prose_text(name: str) -> str:
    """Real English to stream: "pydoc" (`english_text`), "idle" (IDLE's news and readme: change
    notes in prose, about 25k tokens, unlike the reference pages), "licenses" (the licence texts
    Debian ships: legal prose, about 60k tokens), or a path to a text file."""
    if name == "pydoc":
        return english_text()
    if name == "idle":
        folder = os.path.dirname(importlib.util.find_spec("idlelib").origin)
        return "\n\n".join(open(os.path.join(folder, n), encoding="utf-8").read() for n in IDLE_TEXTS)
    if name == "licenses":
        names = sorted(n for n in os.listdir(LICENSES) if not os.path.islink(os.path.join(LICENSES, n)))
        return "\n\n".join(open(os.path.join(LICENSES, n), encoding="utf-8").read() for n in names)
    with open(name, encoding="utf-8") as text:
        return text.read()


def random_text(characters: int, rng: np.random.Generator) -> str:
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ,."), characters))


def parser(description: str, policies: str = ",".join(POLICIES), budgets: str = "1024", tokens: int = 0):
    args = argparse.ArgumentParser(description=description)
    args.add_argument("--policies", default=policies, help="comma-separated policies")
    args.add_argument("--budgets", default=budgets, help="comma-separated budgets (tokens per layer)")
    args.add_argument("--tokens", type=int, default=tokens, help="tokens to stream per run")
    return args


def split_list(text: str, kind=str) -> list:
    values = [kind(v) for v in text.split(",") if v]
    if kind is str:
        unknown = [v for v in values if v not in POLICIES]
        if unknown:
            sys.exit(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return values
