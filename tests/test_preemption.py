"""Pre-emption: signals become a flag, handlers are restored, processes agree."""

import os
import signal
import time

import pytest

from jax_overlap.resilience.preemption import (
    PreemptionWatcher,
    agree_to_stop,
    any_process,
)


class FakeSignals:
    """Records installed handlers instead of touching the process."""

    def __init__(self):
        self.handlers = {signal.SIGTERM: "old-term", signal.SIGINT: "old-int"}

    def signal(self, num, handler):
        previous = self.handlers[num]
        self.handlers[num] = handler
        return previous


def test_fake_sigterm_sets_flag_and_handlers_are_restored():
    fake = FakeSignals()
    with PreemptionWatcher(signal_module=fake) as watcher:
        assert not watcher.stop_requested()
        fake.handlers[signal.SIGTERM](signal.SIGTERM, None)
        assert watcher.stop_requested() and watcher.received == signal.SIGTERM
        fake.handlers[signal.SIGTERM](signal.SIGTERM, None)  # repeats are harmless
    assert fake.handlers == {signal.SIGTERM: "old-term", signal.SIGINT: "old-int"}


def test_second_sigint_forces_keyboard_interrupt():
    fake = FakeSignals()
    with PreemptionWatcher(signal_module=fake) as watcher:
        fake.handlers[signal.SIGINT](signal.SIGINT, None)
        assert watcher.stop_requested() and watcher.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            fake.handlers[signal.SIGINT](signal.SIGINT, None)
    with PreemptionWatcher(signal_module=fake, interrupt_on_repeat=False):
        fake.handlers[signal.SIGINT](signal.SIGINT, None)
        fake.handlers[signal.SIGINT](signal.SIGINT, None)


def test_real_sigterm_is_caught_not_fatal():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher() as watcher:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while not watcher.stop_requested() and time.monotonic() < deadline:
            time.sleep(0.01)  # Python runs the handler at the next bytecode boundary
        assert watcher.stop_requested() and watcher.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_nested_watchers_unwind():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionWatcher(signals=(signal.SIGINT,)) as outer:
        with PreemptionWatcher(signals=(signal.SIGINT,)) as inner:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert inner.stop_requested() and not outer.stop_requested()
        assert signal.getsignal(signal.SIGINT) == outer._handle
    assert signal.getsignal(signal.SIGINT) is before


def test_request_stop_without_signal():
    watcher = PreemptionWatcher(signal_module=FakeSignals())
    watcher.request_stop()
    assert watcher.stop_requested() and watcher.received is None


def test_agree_to_stop_any_process_wins_only_on_check_steps():
    calls = []

    def two_processes(local):  # process 1 of a fake pair got the signal, we did not
        calls.append(local)
        return local or True

    assert [agree_to_stop(False, s, every_steps=4, all_agree=two_processes) for s in range(1, 9)] == [
        False, False, False, True, False, False, False, True,
    ]
    assert calls == [False, False]
    assert not agree_to_stop(False, 3, all_agree=lambda local: local)
    assert agree_to_stop(True, 3, all_agree=lambda local: local)


def test_any_process_single_process():
    assert any_process(True) and not any_process(False)
