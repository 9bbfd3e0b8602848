"""Ids of requests and sequences: one scheme for the engine and the server.

`<prefix>-<32 hex>` (a uuid4): unguessable, so a client cannot reach another client's sequence or
cancel its request by counting, and the prefix says what the id names (`cmpl`, `chatcmpl`, `seq`...).
"""

import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
