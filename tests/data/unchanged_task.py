"""Tasks for tests/test_unchanged.py whose reward is never all-equal on the tiny random model (the
share of vowels among a reply's letters), so that every algorithm's update has a signal to move
the adapters and critics with."""
from marft.envs.base import Grade, Problem, TurnBasedEnv


def vowel_share(text: str) -> float:
    letters = [c for c in (text or "").lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


class Vowels(TurnBasedEnv):
    """Two steps at most; the reward is the vowel share of the answering agent's reply."""

    def new_problem(self, rng, split, index):
        n = index if index is not None else rng.randrange(100)
        return Problem(f"Say a word about {n}.", n)

    def num_problems(self, split):
        return 6 if split == "test" else None

    def grade(self, problem, reply):
        share = vowel_share(reply)
        return Grade(share > 0.4, True, score=share)


class Digits(Vowels):
    """The share of digits among a reply's characters."""

    def grade(self, problem, reply):
        share = sum(c.isdigit() for c in reply) / max(len(reply), 1)
        return Grade(share > 0.2, True, score=share)


class Breaks(Vowels):
    """The problems of odd number fail in the environment (their grading raises)."""

    def grade(self, problem, reply):
        if problem.answer % 2:
            raise RuntimeError("odd problem")
        return super().grade(problem, reply)


def duo(problem, client):
    """An agent program: the planner and the solver in parallel, then the solver reads both."""
    import concurrent.futures as cf

    def ask(agent, text):
        r = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": text}])
        return r.choices[0].message.content

    with cf.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda x: ask(*x), [("planner", problem["prompt"]), ("solver", problem["prompt"])])
    return ask("solver", problem["prompt"] + "\n[planner] " + a + "\n[draft] " + b)


def reward(answer, record):
    return vowel_share(answer)
