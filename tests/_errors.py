"""The check every bad-input test makes: the right exception, naming what to fix."""

import pytest


def assert_refused(call, exception, words):
    """``call()`` raises ``exception`` whose message contains every one of ``words``."""
    with pytest.raises(exception) as caught:
        call()
    message = str(caught.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
