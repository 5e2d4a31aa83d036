from __future__ import annotations

import pytest

from tests.server.transports.webrtc_support import ScriptedEngine


@pytest.fixture
def engine():
    return ScriptedEngine()
