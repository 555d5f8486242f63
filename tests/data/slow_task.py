"""The vowel task of tests/data/unchanged_task.py with a grading that takes time (a tool call), for
tests/test_async.py: a random 0-0.3 s; with MARFT_TEST_SLOW_EVERY=n every n-th grading of the
process takes MARFT_TEST_SLOW_S and the others none; with MARFT_TEST_HANG_S the second grading
hangs that long."""
import os
import random
import threading
import time

from unchanged_task import Vowels

HANG_S = float(os.environ.get("MARFT_TEST_HANG_S", "0"))
SLOW_EVERY, SLOW_S = int(os.environ.get("MARFT_TEST_SLOW_EVERY", "0")), float(os.environ.get("MARFT_TEST_SLOW_S", "0"))
_calls, _lock = [0], threading.Lock()


class Slow(Vowels):
    def grade(self, problem, reply):
        with _lock:
            _calls[0] += 1
            nth = _calls[0]
        if SLOW_EVERY:
            time.sleep(SLOW_S if nth % SLOW_EVERY == 0 else 0.0)
        else:
            time.sleep(HANG_S if HANG_S and nth == 2 else random.choice([0.0, 0.0, 0.02, 0.1, 0.3]))
        return super().grade(problem, reply)
