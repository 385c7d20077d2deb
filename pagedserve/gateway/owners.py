"""Who owns a request, and the ids the services know it by.

Every request belongs to the API key that made it: its owner is a digest of that key (`anon` when
the gateway takes no keys, so a single-tenant server behaves as before). The services below the
gateway never see a client's id as it is: the gateway derives the internal id
`<owner>.<client id>`, and the client only ever sees its own id. So reading, resuming, attaching
to or aborting a request of another owner finds nothing (404, as if it did not exist) without any
lookup, and no client string can collide with another owner's ids or with the scheduler's
forked-sample ids (`X#i`: `#` is not allowed in a client id).

An operator (`--admin-api-key`) sees every request in the engine stats and the dashboard; it owns
its own requests like any key.

Threads: pure functions and frozen values; used on the gateway's event loop.
Invariants: an owner is `anon` or `o` + 16 hex digits, with no `.`; a client id matches
CLIENT_ID_PATTERN; internal id = owner + "." + client id, so owner_of(internal) is unambiguous.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

ANONYMOUS = "anon"
CLIENT_ID_PATTERN = r"[A-Za-z0-9_.:-]{1,128}"
_CLIENT_ID = re.compile(CLIENT_ID_PATTERN)
_OWNER = re.compile(r"(anon|o[0-9a-f]{16})\.")


def owner_of_key(key: str | None) -> str:
    """The owner for an API key (None: the anonymous owner). A digest: the key never appears in
    an id, a Redis key name or a log line."""
    if not key:
        return ANONYMOUS
    return "o" + hashlib.sha256(b"pagedserve-owner\0" + key.encode()).hexdigest()[:16]


def cache_salt(owner: str, client_salt: str, scope: str = "owner") -> str:
    """The prefix cache's salt for a request (SamplingParams.cache_salt, common/prefix_hashes.py):
    under scope "owner" the owner and a digest of the client's cache_salt, so a request shares
    cached blocks only with its own owner's requests of the same salt and cached_tokens tells no
    key what another sent; under "global" the client's cache_salt alone (vLLM's behaviour). A
    client never sets the salt as it is under "owner"."""
    if scope == "global":
        return client_salt
    if not client_salt:
        return owner
    return owner + ":" + hashlib.sha256(client_salt.encode()).hexdigest()[:32]


def parse_key_line(line: str) -> tuple[str, int | None] | None:
    """A line of --api-key-file: `KEY` or `KEY min_priority=N` (None for a blank or # line);
    ValueError for anything else."""
    parts = line.split()
    if not parts or parts[0].startswith("#"):
        return None
    min_priority = None
    for option in parts[1:]:
        name, _, value = option.partition("=")
        if name != "min_priority" or not re.fullmatch(r"-?\d+", value):
            raise ValueError(f"an --api-key-file line is `KEY` or `KEY min_priority=N`; got an option {option!r}")
        min_priority = int(value)
    return parts[0], min_priority


def valid_client_id(client_id: str) -> bool:
    return _CLIENT_ID.fullmatch(client_id) is not None


def client_id_problem(client_id: str) -> str:
    return (f"request_id must match {CLIENT_ID_PATTERN} (letters, digits, '_', '.', ':', '-'; at most 128), "
            f"got {len(client_id)} characters")


def split_internal(internal_id: str) -> tuple[str, str] | None:
    """(owner, client id) of an internal id, or None when it is not one."""
    m = _OWNER.match(internal_id)
    return (m.group(1), internal_id[m.end():]) if m else None


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated caller of one request."""

    owner: str    # owner_of_key(the key it presented)
    admin: bool   # an operator key (or no keys configured at all): sees every request in the stats
    # The lowest `priority` its requests may set (lower runs earlier under --scheduling-policy
    # priority, as vLLM's): 0 for an ordinary key unless its line in --api-key-file says
    # `min_priority=N`; None (any) for an operator and without keys.
    min_priority: int | None = None

    def internal_id(self, client_id: str) -> str:
        return f"{self.owner}.{client_id}"

    def client_id(self, internal_id: str) -> str | None:
        """The caller's own id for an internal id, None when the request is another owner's."""
        parts = split_internal(internal_id)
        return parts[1] if parts is not None and parts[0] == self.owner else None

    def sees(self, internal_id: str) -> bool:
        """Whether the engine stats show this caller the request (its own, or all for an operator)."""
        return self.admin or self.client_id(internal_id) is not None

    def shown_id(self, internal_id: str) -> str:
        """How the stats name a request to this caller: its own by the client id; an operator
        sees other owners' requests by their internal ids."""
        own = self.client_id(internal_id)
        return own if own is not None else internal_id


# The caller when no keys are configured: everybody is the one anonymous owner, and an operator.
SINGLE_TENANT = Caller(ANONYMOUS, admin=True)
