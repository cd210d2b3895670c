"""Loading a hub id without the hub: fail in seconds with what to do, instead of a minute of retries.

`transformers`' `from_pretrained("owner/name")` retries unreachable hosts for about a minute before it fails.
`hub_kwargs` checks first, with one short connection attempt: a reachable hub loads as usual; an unreachable one
loads from the local cache when the files are there (`local_files_only=True`) and otherwise raises a
`VTokenError` naming `HF_HUB_OFFLINE`, local checkpoint directories and the built-in models.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from .errors import VTokenError

CONNECT_TIMEOUT = 3.0  # seconds for the one connection attempt (DNS included)
OFFLINE_VARIABLE = "HF_HUB_OFFLINE"


def endpoint() -> str:
    """The hub's base URL: `HF_ENDPOINT` if set, else huggingface_hub's."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def offline() -> bool:
    """Whether `HF_HUB_OFFLINE` asks for the local cache only."""
    from huggingface_hub import constants

    value = os.environ.get(OFFLINE_VARIABLE)
    return constants.HF_HUB_OFFLINE if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def unreachable(url: str, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """None if a TCP connection to `url`'s host opens within `timeout` seconds, else why not (one line)."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        return f"no host in {url!r}"
    outcome: list[str | None] = []

    def attempt() -> None:  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{type(err).__name__}: {err}")

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    return outcome[0] if outcome else f"no answer from {host}:{port} within {timeout:g} s"


def cached(repo_id: str) -> bool:
    """Whether `repo_id`'s config.json is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def hub_kwargs(repo_id: str) -> dict:
    """Extra `from_pretrained` keywords for hub id `repo_id`: {} when the hub answers, {"local_files_only": True}
    when it does not (or `HF_HUB_OFFLINE` is set) but the files are cached; else a `VTokenError` saying what to do."""
    alternatives = "pass a local checkpoint directory (--model /path/to/checkpoint) or a built-in model (`vtoken list`)"
    if offline():
        if cached(repo_id):
            return {"local_files_only": True}
        raise VTokenError(
            f"{OFFLINE_VARIABLE} is set and {repo_id!r} is not in the local Hugging Face cache; download it once "
            f"with the hub reachable (or unset {OFFLINE_VARIABLE}), or {alternatives}"
        )
    reason = unreachable(endpoint())
    if reason is None:
        return {}
    if cached(repo_id):
        return {"local_files_only": True}
    raise VTokenError(
        f"cannot reach the Hugging Face Hub at {endpoint()} ({reason}) and {repo_id!r} is not in the local cache; "
        f"{alternatives}. Offline on purpose? Set {OFFLINE_VARIABLE}=1 to load from the cache without trying."
    )
