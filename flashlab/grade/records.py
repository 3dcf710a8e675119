"""What grading produces: one record per test, one result per exercise, one submission per notebook.

The outcome of a test is an ``Outcome``; an exercise's ``Status`` (one word in the grade table) is derived from its
tests' outcomes, never from the wording of a message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    """How one test ended."""

    PASSED = "passed"
    WRONG = "wrong"  # an answer the test's checks rejected
    NOT_IMPLEMENTED = "not implemented"  # the stub's NotImplementedError
    RAISED = "raised"  # the learner's function raised
    MUTATED = "mutated input"  # it changed an argument in place
    TIMEOUT = "timeout"  # the exercise's time ran out at or before this test
    CRASHED = "crashed"  # the submission's process died or sent something unreadable
    SYNTAX_ERROR = "syntax error"  # the cell does not parse
    CELL_FAILED = "cell failed"  # the cell's own top-level code raised, or it does not define the function
    MISSING = "missing"  # no exercise cell for this exercise
    FOREIGN = "foreign"  # the exercise belongs to another notebook
    GRADER_ERROR = "grader error"  # the grader's own failure
    NOT_GRADED = "not graded"  # grading was interrupted before this exercise ran
    VOIDED = "voided"  # right values, but the exercise's gate test (how it computes) failed


class Status(enum.Enum):
    """One word for an exercise in the grade table."""

    FULL_MARKS = "full marks"
    PARTIAL = "partial"
    WRONG = "wrong"
    NOT_IMPLEMENTED = "not implemented"
    RAISES = "raises"
    MUTATES_INPUT = "mutates input"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    SYNTAX_ERROR = "syntax error"
    CELL_FAILED = "cell failed"
    MISSING = "missing"
    FOREIGN = "foreign"
    GRADER_ERROR = "grader error"
    NOT_GRADED = "not graded"
    WRONG_METHOD = "wrong method"


# outcomes that, on any test, name the whole exercise's status (first match wins)
_DECISIVE = (
    (Outcome.NOT_GRADED, Status.NOT_GRADED),
    (Outcome.GRADER_ERROR, Status.GRADER_ERROR),
    (Outcome.FOREIGN, Status.FOREIGN),
    (Outcome.MISSING, Status.MISSING),
    (Outcome.SYNTAX_ERROR, Status.SYNTAX_ERROR),
    (Outcome.CELL_FAILED, Status.CELL_FAILED),
    (Outcome.TIMEOUT, Status.TIMEOUT),
    (Outcome.CRASHED, Status.CRASHED),
)


MAX_MESSAGE_CHARS = 2000  # what a learner reads about one test; a check quoting a huge answer is cut here


@dataclass
class TestRecord:
    """One graded test: its points, how it ended, and what the learner reads about it (at most
    ``MAX_MESSAGE_CHARS``, so a quoted answer cannot swell the reports)."""

    test: str  # the test function's name
    name: str  # its one-line description
    max_score: int
    outcome: Outcome
    message: str = "passed"

    def __post_init__(self):
        if len(self.message) > MAX_MESSAGE_CHARS:
            cut = len(self.message) - MAX_MESSAGE_CHARS
            self.message = f"{self.message[:MAX_MESSAGE_CHARS]} ... ({cut:,} more characters not shown)"

    @property
    def score(self) -> int:
        return self.max_score if self.outcome is Outcome.PASSED else 0

    def as_dict(self, exercise_id: str, status: Status) -> dict:
        return {
            "name": f"{exercise_id}: {self.name}",
            "score": self.score,
            "max_score": self.max_score,
            "status": "passed" if self.outcome is Outcome.PASSED else "failed",
            "outcome": self.outcome.value,
            "output": self.message,
            "tags": [exercise_id, status.value],
        }


@dataclass
class ExerciseResult:
    """The tests of one exercise in one submission."""

    exercise_id: str
    tests: list[TestRecord]
    seconds: float = 0.0
    walls: dict = field(default_factory=dict)  # which parts of the sandbox held

    @property
    def score(self) -> int:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> int:
        return sum(t.max_score for t in self.tests)

    @property
    def status(self) -> Status:
        outcomes = {t.outcome for t in self.tests}
        for outcome, status in _DECISIVE:
            if outcome in outcomes:
                return status
        if Outcome.VOIDED in outcomes:
            return Status.WRONG_METHOD
        if outcomes == {Outcome.NOT_IMPLEMENTED}:
            return Status.NOT_IMPLEMENTED
        if self.score == self.max_score:
            return Status.FULL_MARKS
        if Outcome.MUTATED in outcomes:
            return Status.MUTATES_INPUT
        if self.score == 0 and Outcome.RAISED in outcomes:
            return Status.RAISES
        return Status.PARTIAL if self.score else Status.WRONG


@dataclass
class Submission:
    """One notebook: which notebook it is, and its exercises' results."""

    name: str  # as given on the command line, or relative to the folder given
    notebook: str | None = None  # "NN", from the notebook's own metadata and cells
    results: list[ExerciseResult] = field(default_factory=list)
    error: str | None = None  # the notebook could not be read, or could not be identified

    @property
    def score(self) -> int:
        return sum(r.score for r in self.results)

    @property
    def max_score(self) -> int:
        return sum(r.max_score for r in self.results)

    @property
    def complete(self) -> bool:
        return all(r.status is not Status.NOT_GRADED for r in self.results)
