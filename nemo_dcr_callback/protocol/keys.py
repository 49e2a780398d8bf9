"""Every key of the store, in one place (docs/PROTOCOL.md).

Keys under the store's root:

    versions/{v}/rank-{r}/part-{n}.dcr  chunks back to back, each part uploaded as soon as it
                                        is full (receivers may fetch them while later ones are
                                        still being encoded)
    versions/{v}/sums-{r}.json          RankSums: the rank's additive slice digests, read by the
                                        sealer only (receivers get the sums in VERSION.json)
    versions/{v}/rank-{r}.json          RankManifest: parts with sizes and checksums; written
                                        after its last part and its sums
    versions/{v}/VERSION.json           VersionRecord, once every rank's manifest exists:
                                        base, totals, per-tensor digests (If-None-Match)
    versions/{v}/acks/{receiver}.json   Ack: the receiver fetched and verified every chunk and
                                        holds the base (or a refusal, with the reason)
    versions/{v}/DECISION.json          Decision: commit or abort, written with If-None-Match
                                        so exactly one writer decides; commit binds v as the
                                        baseline of the next delta
    receivers/{id}.json                 a receiver's registration: the version it holds
    keyframe/{v}/model.safetensors      a full canonical checkpoint (+ config.json, KEYFRAME.json)
    verify/{v}/model.safetensors        verify mode only: the dense export of version v
    stats/rank-{r}.json                 a sender rank's timings, written when training ends

({v} is zero-padded to 10 digits, {r} to 5, {n} to 6.) Where a version comes from a listing
(a folder name, as listed), the functions taking `v` take that name as it is.
"""

from __future__ import annotations

VERSIONS = "versions"
RECEIVERS = "receivers"
KEYFRAMES = "keyframe"
VERIFY = "verify"
STATS = "stats"
ACKS = "acks"  # the folder of a version's acks
VERSION_FILE = "VERSION.json"
DECISION_FILE = "DECISION.json"
KEYFRAME_FILE = "KEYFRAME.json"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PART_SUFFIX = ".dcr"


VERSION_DIGITS = 10
MAX_VERSION = 10**VERSION_DIGITS - 1


def digits(name: str, width: int) -> int | None:
    """The number a fixed-width name field stands for: exactly `width` ASCII digits; None for
    anything else (str.isdigit takes Arabic-Indic and superscript digits, which int() then reads
    or refuses: a receivers'-token holder made folders that status, gc and resume choked on)."""
    if len(name) == width and name.isascii() and name.isdigit():
        return int(name)
    return None


def version_of(name: str) -> int | None:
    """The version a folder name of versions/, keyframe/ or verify/ stands for, or None: such
    a name is no version, ignored by every reader and refused by the relay."""
    return digits(name, VERSION_DIGITS)


def _num(v: int | str) -> str:
    """A version's folder name: numbers zero-padded, names from a listing as they are."""
    if isinstance(v, str):
        return v
    if not 0 <= v <= MAX_VERSION:
        raise ValueError(f"version {v} is out of range (0 to {MAX_VERSION})")
    return f"{v:010d}"


# ------------------------------------------------------------------ one version
def vdir(v: int | str) -> str:
    return f"{VERSIONS}/{_num(v)}"


def part_key(v: int, r: int, n: int) -> str:
    return f"{vdir(v)}/rank-{r:05d}/part-{n:06d}{PART_SUFFIX}"


def rank_manifest(v: int, r: int) -> str:
    return f"{vdir(v)}/rank-{r:05d}.json"


def rank_sums(v: int, r: int) -> str:
    """Kept out of the rank manifest that every receiver downloads: the record carries the
    sums of these, once per tensor."""
    return f"{vdir(v)}/sums-{r:05d}.json"


def version_record(v: int | str) -> str:
    return f"{vdir(v)}/{VERSION_FILE}"


def acks_dir(v: int) -> str:
    return f"{vdir(v)}/{ACKS}"


def ack_key(v: int, receiver: str) -> str:
    return f"{acks_dir(v)}/{receiver}.json"


def decision_key(v: int | str) -> str:
    return f"{vdir(v)}/{DECISION_FILE}"


# ------------------------------------------------------------------ outside the versions
def receiver_key(receiver: str) -> str:
    return f"{RECEIVERS}/{receiver}.json"


def keyframe_dir(v: int | str) -> str:
    return f"{KEYFRAMES}/{_num(v)}"


def keyframe_record(v: int | str) -> str:
    """The record written last: a keyframe that has one is complete."""
    return f"{keyframe_dir(v)}/{KEYFRAME_FILE}"


def keyframe_model(v: int | str) -> str:
    return f"{keyframe_dir(v)}/{MODEL_FILE}"


def keyframe_config(v: int | str) -> str:
    return f"{keyframe_dir(v)}/{CONFIG_FILE}"


def verify_dir(v: int) -> str:
    return f"{VERIFY}/{_num(v)}"


def verify_key(v: int) -> str:
    return f"{verify_dir(v)}/{MODEL_FILE}"


def stats_key(rank: int) -> str:
    return f"{STATS}/rank-{rank:05d}.json"


# ------------------------------------------------------------------ what a key is
def is_mutable(key: str) -> bool:
    """Acks and registrations: they may appear or change at any time (never cached as present);
    every other object is written once."""
    return key.startswith(f"{RECEIVERS}/") or is_ack(key)


def is_history(key: str) -> bool:
    """Objects of the store's history (parts, manifests, records, decisions, keyframes), of
    every version whatever its decision: written once and never replaced (acks, under a
    version's folder, are the receivers'). Not "committed": that word means only the joint
    commit's decision."""
    return (key.startswith(f"{VERSIONS}/") or key.startswith(f"{KEYFRAMES}/")) and not is_ack(key)


NAME_MAX = 200  # characters of a receiver's name


def name_error(name: str) -> str | None:
    """Why a receiver name is refused (None: it is fine): printable Unicode without surrogates
    (a name with a lone surrogate could not be printed: `status` stopped), no '/', at most
    NAME_MAX characters."""
    if not name or len(name) > NAME_MAX:
        return f"a name of {len(name)} characters (1 to {NAME_MAX})"
    if not name.isprintable() or any(0xD800 <= ord(c) <= 0xDFFF for c in name):
        return f"a name with unprintable characters ({ascii(name)[:60]})"
    if "/" in name or name in (".", ".."):
        return f"a name that is a path ({name!r})"
    return None


def receiver_record(key: str) -> tuple[str, str, int | None] | None:
    """("registration", receiver, None) or ("ack", receiver, version) for a receiver-written
    key, else None: what a receiver's token may write, and whose record it must be."""
    parts = key.split("/")
    if len(parts) == 2 and parts[0] == RECEIVERS and parts[1].endswith(".json") and not name_error(parts[1][:-5]):
        return "registration", parts[1][:-5], None
    if (len(parts) == 4 and parts[0] == VERSIONS and version_of(parts[1]) is not None and parts[2] == ACKS
            and parts[3].endswith(".json") and not name_error(parts[3][:-5])):
        return "ack", parts[3][:-5], int(parts[1])
    return None


def kind(key: str) -> str | None:
    """Which object of the protocol a key names: part, rank_manifest, rank_sums, record, decision, ack,
    registration, keyframe_model, keyframe_config, keyframe_record, verify_model, stats; None
    for any other key (a relay refuses to store it: nothing but the protocol's objects lands
    in the origin)."""
    p = key.split("/")
    own = receiver_record(key)
    if own is not None:
        return own[0]
    if len(p) == 3 and p[0] == VERSIONS and version_of(p[1]) is not None:
        if p[2] in (VERSION_FILE, DECISION_FILE):
            return "record" if p[2] == VERSION_FILE else "decision"
        if p[2].startswith("rank-") and p[2].endswith(".json") and digits(p[2][5:-5], 5) is not None:
            return "rank_manifest"
        if p[2].startswith("sums-") and p[2].endswith(".json") and digits(p[2][5:-5], 5) is not None:
            return "rank_sums"
    if (len(p) == 4 and p[0] == VERSIONS and version_of(p[1]) is not None and p[2].startswith("rank-")
            and digits(p[2][5:], 5) is not None and p[3].startswith("part-") and p[3].endswith(PART_SUFFIX)
            and digits(p[3][5:-len(PART_SUFFIX)], 6) is not None):
        return "part"
    if len(p) == 3 and p[0] == KEYFRAMES and version_of(p[1]) is not None:
        return {MODEL_FILE: "keyframe_model", CONFIG_FILE: "keyframe_config",
                KEYFRAME_FILE: "keyframe_record"}.get(p[2])
    if len(p) == 3 and p[0] == VERIFY and version_of(p[1]) is not None and p[2] == MODEL_FILE:
        return "verify_model"
    if (len(p) == 2 and p[0] == STATS and p[1].startswith("rank-") and p[1].endswith(".json")
            and digits(p[1][5:-5], 5) is not None):
        return "stats"
    return None


def is_ack(key: str) -> bool:
    return f"/{ACKS}/" in key


def is_part(key: str) -> bool:
    return key.endswith(PART_SUFFIX)


def is_rank_manifest(key: str) -> bool:
    return "/rank-" in key and key.endswith(".json")


def is_record_or_decision(key: str) -> bool:
    """A version's record or decision: asked for before it exists (receivers wait for them)."""
    return key.endswith((f"/{VERSION_FILE}", f"/{DECISION_FILE}"))


def version_dir_of(key: str) -> str | None:
    """The folder of the version whose object `key` is (versions/{v}), or None for a key that
    is not inside a version's folder (a version folder itself, or outside the versions)."""
    path = key.split("/")
    if len(path) < 3 or path[0] != VERSIONS:
        return None
    return vdir(path[1])
