"""Session media: a live video session's items cross to an engine process once.

A session's every prefill and question carries all the items of its window (`video_stream.VideoStream`), each
marked with its `session_id`. In process that costs nothing (the requests share the tensors); with the engine core
in its own process (`MPAsyncLLM`) it would pickle the whole window's pixels into every request. So the API side's
`SessionMediaSender` sends an item's arrays to an engine the first time only and a reference (the item without its
arrays) afterwards, and that engine's `SessionMediaStore` keeps the arrays of the session items it was sent and
fills references back in before the core sees the request: the tower can run again whenever the encoder cache
dropped an item's embeddings.

Both sides forget an item on `evict_encoder_items` (what a session sends when a pair leaves its window and, for
all of them, when it closes), in order with the requests on the same socket, so an item sent after its eviction
carries its arrays again and the store holds only open sessions' windows. A reference the store cannot fill (a
bug, or an engine that lost its store) is refused with `SessionMediaMissing`; the sender then sends everything whole
to that engine again, starting with that request (once; a second refusal reaches the caller).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from vlserve.multimodal.inputs import MultiModalFeature

SESSION_REF_KEY = "session_media_ref"  # in a reference's data: its arrays are in the engine's store


class SessionMediaMissing(ValueError):
    """A request referenced a session item that the engine's store does not hold."""


def _is_array(value: object) -> bool:
    """Tensors and numpy arrays (pixels, grids): what the store keeps; scalars and lists vary per request."""
    return hasattr(value, "nbytes") and hasattr(value, "shape")


def _store_key(mm_hash: str) -> str:
    """An item's key without an encoder adapter's `:lora:<id>` suffix (the pixels are the same)."""
    return mm_hash.split(":lora:", 1)[0]


def as_reference(feature: MultiModalFeature) -> MultiModalFeature:
    """The item without its arrays, marked as a reference (its per-request scalars and lists stay)."""
    data = {k: v for k, v in feature.data.items() if not _is_array(v)}
    data[SESSION_REF_KEY] = True
    return replace(feature, data=data)


class SessionMediaStore:
    """Engine side: mm_hash -> the arrays of a session item this engine was sent."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}

    def __len__(self) -> int:
        return len(self.items)

    def resolve(self, features: list[MultiModalFeature]) -> list[MultiModalFeature]:
        """The request's items with references filled in from the store (`SessionMediaMissing` if one is not
        held), and the arrays of session items that came whole stored for later references."""
        out = []
        for f in features:
            if f.session_id is None:
                out.append(f)
            elif f.data.get(SESSION_REF_KEY):
                arrays = self.items.get(_store_key(f.mm_hash))
                if arrays is None:
                    raise SessionMediaMissing(
                        f"video session {f.session_id}: this engine no longer holds media item {f.mm_hash}; "
                        "ask again (its frames will be sent again)"
                    )
                data = {k: v for k, v in f.data.items() if k != SESSION_REF_KEY}
                out.append(replace(f, data={**arrays, **data}))
            else:
                self.items[_store_key(f.mm_hash)] = {k: v for k, v in f.data.items() if _is_array(v)}
                out.append(f)
        return out

    def evict(self, mm_hashes: Iterable[str]) -> int:
        """Forget these items; returns how many were held."""
        return sum(self.items.pop(_store_key(h), None) is not None for h in mm_hashes)


def session_of(features: list[MultiModalFeature]) -> str | None:
    """The live video session whose items these are (None: not a session's request)."""
    return next((f.session_id for f in features if f.session_id is not None), None)


class SessionMediaSender:
    """API side: which session items each engine (by index) was sent whole."""

    def __init__(self, num_engines: int):
        self.sent: list[set[str]] = [set() for _ in range(num_engines)]
        # user request id -> (engine, its engine requests whole, resent already): until the engine's AddAck
        self.unacked: dict[str, tuple[int, list, bool]] = {}

    def send_requests(self, request_id: str, engine: int, requests: list) -> list:
        """A session's EngineCoreRequests as `engine` gets them, remembered until `acked`."""
        self.unacked[request_id] = (engine, requests, False)
        return self.outgoing_requests(engine, requests)

    def acked(self, request_id: str, error: BaseException | None, may_resend: bool) -> list | None:
        """The engine answered a session request: when it lacked an item (`SessionMediaMissing`), everything is
        sent whole to it again, and the requests to send once more (their media whole) are returned when
        `may_resend` (the request is still open) and it was not resent already."""
        entry = self.unacked.pop(request_id, None)
        if entry is None or not isinstance(error, SessionMediaMissing):
            return None
        engine, requests, resent = entry
        self.forget_engine(engine)
        if resent or not may_resend:
            return None
        self.unacked[request_id] = (engine, requests, True)
        return self.outgoing_requests(engine, requests)

    def outgoing(self, engine: int, features: list[MultiModalFeature]) -> list[MultiModalFeature]:
        """The items as `engine` gets them: a session item it was sent already as a reference."""
        sent = self.sent[engine]
        out = []
        for f in features:
            key = _store_key(f.mm_hash)
            if f.session_id is not None and key in sent:
                out.append(as_reference(f))
            else:
                if f.session_id is not None:
                    sent.add(key)
                out.append(f)
        return out

    def outgoing_requests(self, engine: int, requests: list) -> list:
        """EngineCoreRequests as `engine` gets them (`outgoing` applied to their items)."""
        return [replace(r, mm_features=self.outgoing(engine, r.mm_features)) for r in requests]

    def forget(self, mm_hashes: Iterable[str]) -> None:
        """These items were evicted (sent to every engine in order with the requests): send them whole again."""
        keys = {_store_key(h) for h in mm_hashes}
        for sent in self.sent:
            sent -= keys

    def forget_engine(self, engine: int) -> None:
        """`engine` refused a reference: send it everything whole again."""
        self.sent[engine].clear()

    @property
    def num_sent(self) -> int:
        """Items sent and not evicted, over all engines."""
        return sum(len(s) for s in self.sent)
