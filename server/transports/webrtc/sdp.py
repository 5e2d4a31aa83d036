"""Checks on a client's SDP offer, so a bad offer gets a 400 naming the problem instead of a broken call.

aiortc accepts some malformed offers silently (text without any media section yields an empty answer), so
we check what a voice call needs before building a peer: an audio section offering Opus, ICE credentials
and a DTLS fingerprint.
"""

from __future__ import annotations

from aiortc.sdp import SessionDescription

MAX_SDP_BYTES = 64 * 1024


class OfferError(ValueError):
    """The offer cannot start a call; the message says why (sent to the client)."""


def check_offer(body: bytes) -> str:
    """Raw request body -> the offer text, or OfferError."""
    if not body:
        raise OfferError("the request body is empty; send the SDP offer as application/sdp")
    if len(body) > MAX_SDP_BYTES:
        raise OfferError(f"the SDP offer is {len(body)} bytes; the limit is {MAX_SDP_BYTES}")
    try:
        sdp = body.decode("utf-8")
    except UnicodeDecodeError:
        raise OfferError("the SDP offer is not UTF-8 text") from None
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError("not an SDP offer: it must start with 'v=0'")
    try:
        desc = SessionDescription.parse(sdp)
    except Exception as e:  # aiortc's parser raises assorted errors on malformed lines
        raise OfferError(f"malformed SDP: {type(e).__name__}: {e}") from None
    audio = [m for m in desc.media if m.kind == "audio"]
    if not audio:
        raise OfferError("the offer has no audio media section (m=audio); add an audio track or transceiver")
    if not any(c.mimeType.lower() == "audio/opus" for m in audio for c in m.rtp.codecs):
        raise OfferError("the offer's audio section does not offer Opus (audio/opus 48000/2)")
    for m in desc.media:
        if m.ice is None or not m.ice.usernameFragment or not m.ice.password:
            raise OfferError(f"the {m.kind} section has no ICE credentials (a=ice-ufrag / a=ice-pwd)")
        if m.dtls is None or not m.dtls.fingerprints:
            raise OfferError(f"the {m.kind} section has no DTLS fingerprint (a=fingerprint)")
    return sdp
