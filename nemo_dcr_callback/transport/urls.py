"""Secrets never leave in a printed URL: user info (user:password@) is masked wherever a URL
is shown or raised, and the store refuses credentials inside an s3:// URL."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"?#]*@")


def redact(text: str) -> str:
    """text with the user info of every URL in it replaced by ***."""
    return _USERINFO.sub(r"\1***@", text)
