"""Unguessable, self-verifying IDs for futures and sessions.

A future ID (the ``request_id`` the SDK polls) is::

    f<run:8 hex>-<host:1-16 of [a-z0-9]>-<random:32 hex>-<mac:16 hex>

* ``run`` identifies the server run that issued it, so a poll for an ID of an
  earlier run answers 410 (the SDK then resubmits) instead of 404.
* ``host`` is the issuing gateway host's ``server.host_id``: always the second
  ``-``-separated field, so a load balancer routes a poll to the future's owner
  without knowing anything else of the format (HAProxy:
  ``json_query('$.request_id'),field(2,-)``; see :mod:`shardserver.haproxy`).
* ``random`` carries 128 random bits: one client cannot read another's result
  by counting.
* ``mac`` is a keyed BLAKE2b of (run, host, random, owner) with the secret: an
  ID this run never issued (or issued to another API key) is answered 404. An
  ID whose MAC verifies but whose host part names another host (its owner is
  down, so the balancer sent the poll elsewhere) is answered 410; that needs
  the hosts to share ``server.id_secret``. An ID whose host part was edited is
  served by no host: the issuer and third hosts answer 404, the host it now
  names sees another run's ID and answers 410 as for any earlier run.

IDs of the format before host ids (``f<run>-<random>-<mac>``) come from an
earlier run by construction and are answered 410 as well.

The owning shard is ``blake2b(id) mod S``; encoder ``s`` mints IDs by drawing
random parts until the hash lands on ``s`` (S draws on average).

Session and sampling-session IDs are signed the same way and carry what the
front-ends need (the base model), so any front-end can serve any request with
no shared session table.

The secret outlives the run (:func:`load_id_secret`): ``server.id_secret`` when set, else the
file ``<server.state_dir>/id_secret``, created once with mode 0600. So after a restart session
IDs stay valid, while future IDs carry the new run's prefix and those of the earlier run
answer 410 (the SDK resubmits).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import json
import os
import re
import stat
from dataclasses import dataclass, field

from .errors import ConfigError

__all__ = ["IdSigner", "FutureIdStatus", "shard_of", "SamplingSession", "HOST_ID_RE", "future_host", "IdSecret",
           "load_id_secret", "restore_secret_file", "ID_SECRET_FILE", "MIN_SECRET_CHARS", "CURSOR_TAG_SPAN", "cursor_tag"]

ID_SECRET_FILE = "id_secret"
MIN_SECRET_CHARS = 16

# The host group is optional only to recognise IDs minted before host ids existed.
_FID_RE = re.compile(r"^f([0-9a-f]{8})-(?:([a-z0-9]{1,16})-)?([0-9a-f]{32})-([0-9a-f]{16})$")
HOST_ID_RE = re.compile(r"[a-z0-9]{1,16}")


# The session-wide poller's cursors (completion stamps, ns) of one server run are all congruent to
# the run's tag modulo CURSOR_TAG_SPAN, so a cursor the SDK got from another clock (the host
# rebooted, the state directory moved to another host) is recognised instead of being taken as a
# point of this run's clock (it could pass completions nobody reported; shardserver/api/futures.py).
CURSOR_TAG_SPAN = 1024


def cursor_tag(run_id: str) -> int:
    """The cursor tag of the server run ``run_id`` (8 hex characters): 1..CURSOR_TAG_SPAN - 1,
    the remainder modulo :data:`CURSOR_TAG_SPAN` of every completion stamp (ns) of the run."""
    return 1 + int(run_id, 16) % (CURSOR_TAG_SPAN - 1)


def shard_of(id_str: str, shards: int) -> int:
    """Shard index (0..shards-1) that owns a future ID or a dedupe key."""
    h = hashlib.blake2b(id_str.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % shards


def future_host(fid: str) -> str:
    """The host part of a future ID (``""`` if it has none); what the balancer routes on."""
    parts = fid.split("-")
    return parts[1] if len(parts) == 4 else ""


class FutureIdStatus(enum.Enum):
    """What :meth:`IdSigner.check_future_id` makes of a future ID."""

    OK = "ok"                       # issued by this run to this owner
    FOREIGN_RUN = "foreign_run"     # well-formed, from an earlier run: 410
    FOREIGN_HOST = "foreign_host"   # valid MAC, issued by another gateway host: 410
    INVALID = "invalid"             # malformed or never issued: 404


#: How many opened sampling-session IDs an :class:`IdSigner` remembers.
OPENED_CACHE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class SamplingSession:
    """What a sampling-session ID carries (mirrors the SDK's create_sampling_session fields)."""

    session_id: str
    base_model: str | None
    model_path: str | None
    seq: int


class IdSigner:
    """Mints and verifies IDs with one run's secret.

    Args:
        secret: the signing key (bytes, any length up to 64); shared by every host behind one balancer.
        run_id: 8 lowercase hex characters naming this server run.
        host_id: this gateway host's ``server.host_id`` (1-16 of ``[a-z0-9]``), written into future IDs.

    Raises:
        ValueError: ``run_id`` or ``host_id`` malformed.
    """

    def __init__(self, secret: bytes, run_id: str, host_id: str = "h0") -> None:
        if not re.fullmatch(r"[0-9a-f]{8}", run_id):
            raise ValueError(f"run_id must be 8 hex characters, got {run_id!r}")
        if not HOST_ID_RE.fullmatch(host_id):
            raise ValueError(f"host_id must be 1-16 characters of [a-z0-9], got {host_id!r}")
        self._key = hashlib.blake2b(secret, digest_size=32).digest()
        # Sampling-session IDs this signer opened, by (ID, owner): every asample of a session
        # carries the same ID, and a verified ID stays valid for the signer's life.
        self._opened: dict[tuple[str, str], SamplingSession] = {}
        self.run_id = run_id
        self.host_id = host_id

    def _mac(self, msg: str, n: int = 8) -> str:
        return hashlib.blake2b(msg.encode(), key=self._key, digest_size=n).hexdigest()

    # -- futures ---------------------------------------------------------------------------
    def mint_future_id(self, shard: int, shards: int, owner: str = "") -> str:
        """A fresh future ID of this run and host whose :func:`shard_of` is ``shard``."""
        run, host = self.run_id, self.host_id
        while True:
            rnd = os.urandom(16).hex()
            fid = f"f{run}-{host}-{rnd}-{self._mac(f'{run}.{host}.{rnd}.{owner}')}"
            if shard_of(fid, shards) == shard:
                return fid

    def check_future_id(self, fid: object, owner: str = "") -> FutureIdStatus:
        """Classify a future ID: :class:`FutureIdStatus` OK, FOREIGN_RUN, FOREIGN_HOST or INVALID.

        Another host's ID is FOREIGN_HOST only if its MAC verifies with this signer's secret
        (so a changed host part is INVALID); an ID of an earlier run of this host is
        FOREIGN_RUN without a MAC check (that run's secret may have been a random one).
        """
        if not isinstance(fid, str):
            return FutureIdStatus.INVALID
        m = _FID_RE.match(fid)
        if m is None:
            return FutureIdStatus.INVALID
        run, host, rnd, mac = m.groups()
        if host is None:
            return FutureIdStatus.FOREIGN_RUN  # minted before host ids: an earlier run
        if host == self.host_id and run != self.run_id:
            return FutureIdStatus.FOREIGN_RUN
        if not hmac.compare_digest(mac, self._mac(f"{run}.{host}.{rnd}.{owner}")):
            return FutureIdStatus.INVALID
        return FutureIdStatus.OK if host == self.host_id else FutureIdStatus.FOREIGN_HOST

    # -- sessions --------------------------------------------------------------------------
    def _sign_payload(self, prefix: str, payload: dict, owner: str) -> str:
        body = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).decode().rstrip("=")
        return f"{prefix}{body}.{self._mac(f'{prefix}.{body}.{owner}', 12)}"

    def _open_payload(self, prefix: str, token: object, owner: str) -> dict | None:
        if not isinstance(token, str) or not token.startswith(prefix) or "." not in token or len(token) > 4096:
            return None
        body, _, mac = token[len(prefix):].rpartition(".")
        if not hmac.compare_digest(mac, self._mac(f"{prefix}.{body}.{owner}", 12)):
            return None
        try:
            return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except ValueError:
            return None

    def mint_session_id(self, owner: str = "") -> str:
        return self._sign_payload("s-", {"r": os.urandom(12).hex()}, owner)

    def check_session_id(self, token: object, owner: str = "") -> bool:
        return self._open_payload("s-", token, owner) is not None

    def mint_sampling_session_id(self, sess: SamplingSession, owner: str = "") -> str:
        return self._sign_payload(
            "ss-", {"s": sess.session_id[-16:], "b": sess.base_model, "p": sess.model_path,
                    "q": sess.seq, "r": os.urandom(6).hex()}, owner)

    def open_sampling_session_id(self, token: object, owner: str = "") -> SamplingSession | None:
        """The :class:`SamplingSession` a signed ID carries, or None if it is not ours.

        Successful opens are remembered (up to :data:`OPENED_CACHE_SIZE` IDs, then the memory
        starts over), so a session's next ``asample`` skips the MAC and the payload decode."""
        key = (token, owner)
        if isinstance(token, str):
            hit = self._opened.get(key)  # type: ignore[arg-type]
            if hit is not None:
                return hit
        p = self._open_payload("ss-", token, owner)
        if p is None:
            return None
        sess = SamplingSession(session_id=str(p.get("s", "")), base_model=p.get("b"),
                               model_path=p.get("p"), seq=int(p.get("q", 0)))
        if len(self._opened) >= OPENED_CACHE_SIZE:
            self._opened.clear()
        self._opened[key] = sess  # type: ignore[index]
        return sess


# -- the signing secret ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class IdSecret:
    """The signing secret of a run and where it came from.

    Attributes:
        secret: the key bytes handed to :class:`IdSigner` (the stripped file content, or
            ``server.id_secret`` UTF-8 encoded, or 32 random bytes).
        source: for the log: ``"server.id_secret"``, the file path, or ``"random"``.
        persistent: whether the next run will use the same secret (sessions survive a restart).
        created: the file was created by this call.
        warnings: lines to log at WARNING (a readable-by-others file, the reason for ``random``).
    """

    secret: bytes
    source: str
    persistent: bool
    created: bool = False
    warnings: tuple[str, ...] = field(default=())


def load_id_secret(id_secret: str, state_dir: str, require_persistent: bool) -> IdSecret:
    """The run's ID signing secret, persistent across restarts.

    1. ``id_secret`` (``server.id_secret`` / ``SHARDSERVER_SERVER__ID_SECRET``) when non-empty;
    2. else the file ``<state_dir>/id_secret``: read if it exists (its content, whitespace
       stripped, at least :data:`MIN_SECRET_CHARS` characters); otherwise created with
       64 random hex characters, mode 0600, in ``state_dir`` (made with mode 0700 if missing).
       Creation writes a temporary file and links it into place, so two servers starting at
       once end up with the same secret;
    3. if that fails (or ``state_dir`` is empty): a random secret for this run only, with a
       warning, unless ``require_persistent`` is true.

    Raises:
        ConfigError: (key ``server.state_dir``) ``require_persistent`` is true and the secret
            file cannot be read or created, or (either mode) the file exists but holds fewer than
            :data:`MIN_SECRET_CHARS` characters.
    """
    if id_secret:
        return IdSecret(id_secret.encode(), "server.id_secret", persistent=True)
    fallback = ("set server.state_dir to a writable directory, or give the secret in server.id_secret "
                "(SHARDSERVER_SERVER__ID_SECRET)")
    if not state_dir:
        problem = "server.state_dir is empty and there is no $XDG_STATE_HOME or $HOME to put it under"
    else:
        path = os.path.join(state_dir, ID_SECRET_FILE)
        try:
            return _read_or_create_secret(path)
        except OSError as exc:
            problem = f"cannot read or create the ID signing secret {path}: {exc.strerror or exc}"
    if require_persistent:
        raise ConfigError("server.state_dir", f"{problem} (server.require_persistent_secret = true: sessions "
                                              f"must survive restarts; {fallback})")
    return IdSecret(os.urandom(32), "random", persistent=False,
                    warnings=(f"{problem}: signing IDs with a random secret for this run only, so SDK sessions "
                              f"will not survive a restart ({fallback})",))


def _read_or_create_secret(path: str) -> IdSecret:
    created = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        created = _create_secret_file(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file")
        raw = os.read(fd, 65536)
    finally:
        os.close(fd)
    secret = raw.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError("server.state_dir", f"the ID signing secret {path} holds {len(secret)} characters; it "
                                              f"needs at least {MIN_SECRET_CHARS} (delete it to have a new one "
                                              "created, which ends the sessions of earlier runs)")
    warnings = ()
    if st.st_mode & 0o077:
        warnings = (f"the ID signing secret {path} is readable by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it",)
    return IdSecret(secret, path, persistent=True, created=created, warnings=warnings)


def restore_secret_file(secret: IdSecret) -> bool:
    """Write the file a persistent secret came from again if it is gone (a ``/tmp`` cleaner or
    an ``rm -rf`` of ``server.state_dir`` mid-run), with the same secret, mode 0600 (its
    directories made again with mode 0700), so that the next run signs IDs as this one does and
    the SDK's sessions survive the restart. Returns True when it wrote the file; False when
    the file is there, or the secret did not come from a file.

    Raises:
        OSError: the file is missing and cannot be written.
    """
    path = secret.source
    if not secret.persistent or path in ("server.id_secret", "random") or os.path.lexists(path):
        return False
    return _create_secret_file(path, secret.secret + b"\n")


def _create_secret_file(path: str, content: bytes | None = None) -> bool:
    """Create ``path`` with ``content`` (default: a fresh secret); False if another process
    created it first."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        try:
            os.write(fd, content if content is not None else (os.urandom(32).hex() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and never replaces a secret another process just wrote
        except FileExistsError:
            return False
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return True
    finally:
        os.unlink(tmp)
