"""What a caller of vLLM's dev-mode routes may make this package's engine do (docs/SECURITY.md).

Served through HTTP (VLLM_SERVER_DEV_MODE: `nemo-dcr receive --vllm`, integrations/vllm_serve.py,
or `vllm serve` itself), anyone who reaches the port can call the worker extension and the
weight-transfer engine, so what they name is pinned: with NEMO_DCR_VLLM_STORE set at start-up
only that store; without it, a dev-mode server takes no relay off this machine (the relay
token would go to it); the operator's NEMO_DCR_VLLM_ANY_STORE=1 lifts both. A model folder a
caller names must be the one served.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from nemo_dcr_callback.integrations.vllm_serve import ANY_STORE_ENV, SERVED_DIR_ENV, STORE_ENV
from nemo_dcr_callback.launcher import is_loopback
from nemo_dcr_callback.protocol.store import redact

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /collective_rpc and its RL routes only with it


def _dev_mode() -> bool:
    """Does this process serve vLLM's unauthenticated dev-mode routes (read as vLLM reads it)?"""
    v = os.environ.get(DEV_MODE_ENV, "0").strip()
    try:
        return bool(int(v))
    except ValueError:
        return True  # (vLLM fails on such a value; counted as on: the checks stay)


def _off_loopback_relays(store_url: str) -> list[str]:
    """The relays of a store URL (a failover chain too) that are not on this machine: each
    would be sent the relay token. A URL whose host cannot be read counts as one."""
    out = []
    for part in (p.strip() for p in store_url.split(",")):
        try:
            u = urlparse(part)
            scheme, host = u.scheme, u.hostname
        except ValueError:  # ("relay://[::1": no host to tell)
            scheme, host = part.split(":", 1)[0].lower(), None
        if scheme in ("relay", "relays") and not (host and is_loopback(host)):
            out.append(redact(part))
    return out


def check_store_allowed(store_url: str) -> None:
    """Refuse a store this engine may not follow (PermissionError), before anything changes.
    A server started with a store (NEMO_DCR_VLLM_STORE: `receive --vllm` sets it) follows only
    that one. Without that pin, a server exposing the dev-mode routes refuses a relay off this
    machine: the relay token would go to whoever the caller names. NEMO_DCR_VLLM_ANY_STORE=1,
    set by the operator, lifts both."""
    if os.environ.get(ANY_STORE_ENV) == "1":
        return
    pinned = os.environ.get(STORE_ENV)
    if pinned is not None:
        if store_url != pinned:
            raise PermissionError(f"dcr: this engine follows only the store it was started for ({STORE_ENV}), not "
                                  f"{redact(store_url)!r}; another store needs the operator's {ANY_STORE_ENV}=1")
        return
    far = _off_loopback_relays(store_url) if _dev_mode() else []
    if far:
        raise PermissionError(f"dcr: this server exposes its dev-mode routes ({DEV_MODE_ENV}) and was started with no "
                              f"store ({STORE_ENV}): it sends the relay token to no relay off this machine, and "
                              f"{far[0]!r} is one. Start it with {STORE_ENV}=<that store URL> (or the operator's "
                              f"{ANY_STORE_ENV}=1)")


def served_dir(model: str | None) -> Path | None:
    """The folder this engine serves: NEMO_DCR_VLLM_MODEL_DIR (`receive --vllm` sets it), else
    the engine's model where that is a local folder (None: a hub name, nothing pinned)."""
    served = os.environ.get(SERVED_DIR_ENV)
    if served is not None:
        return Path(served).resolve()
    if model and Path(model).is_dir():
        return Path(model).resolve()
    return None


def check_model_dir(model_dir: str | None, model: str | None, what: str = "model_dir") -> str | None:
    """The checkpoint whose headers name the tensors: the served model's folder (`model`: the
    engine's model_config.model). Another folder is refused (PermissionError naming both): a
    caller of the dev-mode routes may not make the engine read any folder of the host; where
    the served model is no local folder (a hub name), one is taken only outside dev mode."""
    if not model_dir:
        return model
    _check_folder(f"dcr: {what}", model_dir, model)
    return model_dir


def _check_folder(what: str, folder: str, model: str | None) -> None:
    served = served_dir(model)
    if served is None:
        if _dev_mode():
            raise PermissionError(f"{what} {folder!r}: this server exposes its dev-mode routes and serves {model!r}, "
                                  f"no local folder: set {SERVED_DIR_ENV} to the served checkpoint's folder at "
                                  "start-up")
    elif Path(folder).resolve() != served:
        raise PermissionError(f"{what} {folder!r}: this engine reads only the folder it serves, {str(served)!r}")


def check_reload_allowed(model_dir: str, model: str | None = None) -> None:
    """Refuse a dense reload from any folder but the served model's (PermissionError) where
    the folder is pinned (NEMO_DCR_VLLM_MODEL_DIR) or a dev-mode caller names it. An engine in
    its own program (`LLM`) reloads any folder it is given: a resync from a newer export."""
    if os.environ.get(SERVED_DIR_ENV) is not None or _dev_mode():
        _check_folder("dcr_reload_dense: folder", model_dir, model)
