"""The graded exercises: one module per notebook, each holding its exercises' specs and their pytest tests.

An exercise is a function the learner writes in a notebook cell tagged ``exercise``. Its spec (``Exercise``)
gives the id (``"01.online_softmax_update"``: notebook number, then the function's name), the stub the learner
starts from, and the notebook it belongs to. Its tests are ordinary pytest functions in the notebook's module,
marked with ``@graded(exercise_id, points)``, that take the learner's function as the fixture ``answer``.

The tests run in the grader's own process; ``answer`` sends each call's inputs to the learner's function, which runs
in a walled-in process of its own, and returns the plain value it gave back (``flashlab.grade.worker.Answer``).
So a test can also ask how the answer computes: ``answer.measure(...)`` gives the peak memory of the call,
``answer.stream(blocks)`` hands a streaming answer one block at a time. The same tests run in two places, through
the same code path (``flashlab.grade``):

- inline, in the notebook: ``flashlab.grade.check("01.online_softmax_update", online_softmax_update)``;
- in batch, for an instructor: ``python -m flashlab.grade SUBMISSION... --out DIR``.

Tests use the lesson's examples *and* fresh random inputs, so an answer that only reproduces the lesson's numbers
does not pass.
"""

from __future__ import annotations

import importlib
import textwrap
from dataclasses import dataclass

# notebook number -> module holding that notebook's exercises
MODULES = {
    "01": "flashlab.exercises.nb01_online_softmax",
    "02": "flashlab.exercises.nb02_traffic",
    "03": "flashlab.exercises.nb03_tiling",
    "04": "flashlab.exercises.nb04_triton",
    "05": "flashlab.exercises.nb05_timing",
    "06": "flashlab.exercises.nb06_decode",
    "07": "flashlab.exercises.nb07_kv_cache",
    "08": "flashlab.exercises.nb08_exactness",
    "09": "flashlab.exercises.nb09_backward",
    "10": "flashlab.exercises.nb10_ring",
}


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: what the learner writes, and how the stub reads."""

    id: str  # "NN.function_name"
    title: str  # one line, shown in reports and in the notebook
    signature: str  # the parameter list, e.g. "m, l, block"
    doc: str  # the stub's docstring: what to compute, shapes in and out
    imports: str = "import numpy as np"  # the stub cell's imports (the grader sees only the exercise cell)
    time_limit_s: float = 20.0  # the whole exercise, all its tests
    memory_mib: int = 1024  # address space of the learner's process
    triton: bool = False  # run the learner's process with Triton's interpreter (TRITON_INTERPRET=1)
    check_inputs: bool = True  # a call that changes its arguments in place fails the test
    child_imports: tuple[str, ...] = ("numpy",)  # imported in the learner's process before it is walled in
    harness: str | None = None  # a module of this package that runs the learner's function (``run(fn, ...)``)

    @property
    def notebook(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.id.split(".", 1)[1]

    @property
    def module(self) -> str:
        return MODULES[self.notebook]

    def stub_source(self) -> str:
        """The code of the learner's exercise cell before they start."""
        doc = textwrap.indent(textwrap.dedent(self.doc).strip(), "    ")
        head = f"{self.imports}\n\n\n" if self.imports else ""
        return (
            f"{head}def {self.name}({self.signature}):\n"
            f'    """{doc.lstrip()}\n    """\n'
            "    # YOUR CODE HERE\n"
            f'    raise NotImplementedError("{self.name}: not implemented yet")'
        )

    def check_source(self) -> str:
        """The code of the inline check cell that follows the exercise."""
        return f'from flashlab.grade import check\n\ncheck("{self.id}", {self.name})'


def graded(exercise_id: str, points: int, gate: bool = False):
    """Mark a test function as one graded test of ``exercise_id`` worth ``points``.

    A ``gate`` test checks the way the answer computes, the point of the exercise (it tiles, it streams): if it
    fails, the exercise's other tests earn nothing either, however right the values.
    """

    def mark(fn):
        fn.flashlab_exercise = exercise_id
        fn.flashlab_points = points
        fn.flashlab_gate = gate
        return fn

    return mark


def exercises_of(notebook: str) -> list[Exercise]:
    """The exercises of notebook ``"NN"``, in the order the notebook shows them."""
    mod = importlib.import_module(MODULES[notebook])
    return list(mod.EXERCISES)


def all_exercises() -> dict[str, Exercise]:
    """Every exercise, by id, in notebook order."""
    out = {}
    for nb in MODULES:
        for ex in exercises_of(nb):
            out[ex.id] = ex
    return out


def get(exercise_id: str) -> Exercise:
    """The exercise with this id; ValueError naming the known ids if there is none."""
    nb = exercise_id.split(".", 1)[0]
    if nb in MODULES:
        for ex in exercises_of(nb):
            if ex.id == exercise_id:
                return ex
    known = ", ".join(all_exercises())
    raise ValueError(f"no exercise {exercise_id!r}; known exercises: {known}")


def tests_of(exercise_id: str) -> list:
    """The test functions of one exercise, in file order, each with ``flashlab_points``."""
    ex = get(exercise_id)
    mod = importlib.import_module(ex.module)
    return [
        fn
        for name, fn in vars(mod).items()
        if name.startswith("test_") and getattr(fn, "flashlab_exercise", None) == exercise_id
    ]


def max_points(exercise_id: str) -> int:
    return sum(fn.flashlab_points for fn in tests_of(exercise_id))
