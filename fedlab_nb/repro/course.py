"""The course: lessons built from the claims files, and exercises that grade themselves.

Inside a notebook (a plain Jupyter kernel is enough):

    from fedlab_nb import repro
    repro.check_exercise("> 0.03", gap)                        # PASS: ... / TRY AGAIN: ... (got ..., expected ...)
    repro.check_exercise("within 1e-9 of library", mine, library=fed.heterogeneity("emd"))
    repro.check_exercise("gap > 0.03", gap=gap)                # the value named on the left

The expectation uses the claims files' grammar (papers/SCHEMA.md, fedlab_nb/repro/expect.py); names on the
right-hand side are the keyword arguments. A per-seed list is judged like a seeded claim (90 % one-sided t
interval). When the notebook is executed by the test harness or `fedlab-nb reproduce` (FEDLAB_NB_RUN_DIR is
set), a TRY AGAIN also raises ExerciseFailed, so CI fails when an instructor's solution stops passing; set
FEDLAB_NB_EXERCISES=lenient (or strict) to choose explicitly.

Outside a notebook: `build_syllabus(root)` writes the syllabus (docs/syllabus.md) from papers/*.yaml, the
notebooks' exercise sections and the smoke-scale seconds; `student_notebook(nb)` replaces the solution cells
(code cells tagged `solution`) by stubs; `write_course(root, out)` writes both versions (scripts/make_course.py).
"""
from __future__ import annotations

import ast
import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .expect import ExpectationError, MetricError, parse_expectation
from .recording import RUN_DIR_ENV, to_json_value

SOLUTION_TAG = "solution"
STUB_TAG = "student-stub"            # what a solution cell is tagged in the student version
EXERCISES_ENV = "FEDLAB_NB_EXERCISES"  # "strict": TRY AGAIN raises; "lenient": it only prints
GRAMMAR = ("'< x', '<= x', '> x', '>= x', '== x', 'within TOL of x', 'within P% of x' or 'between a and b', "
           "where x, a, b are numbers, names passed as keywords, + - * and parentheses, optionally preceded by the "
           "name of the value being checked ('gap > 0.03', gap=...); see papers/SCHEMA.md")
STUB_LINE = "# YOUR CODE HERE: replace each `...` by your answer; the next cell checks it"


class ExerciseFailed(AssertionError):
    """Raised after TRY AGAIN when exercises are strict (the notebook runs under the test harness)."""


class CourseError(ValueError):
    """A claims file the course does not place, or a lesson table that is inconsistent."""


# ---------------------------------------------------------------------------------------------- lessons
@dataclass(frozen=True)
class Lesson:
    key: str
    title: str
    papers: tuple          # paper ids (papers/<id>.yaml), in teaching order
    prerequisites: tuple   # keys of earlier lessons
    goals: tuple           # learning goals, one sentence each
    background: str = ""   # what a student should know from outside the course


LESSONS = (
    Lesson("basics", "FedAvg and non-IID data", ("fedavg_noniid", "partitions"), (),
           ("write FedAvg in plain PyTorch and check it against fl.simulate to float rounding",
            "partition a data set (IID, Dirichlet(α), shards, pathological, quantity, feature, natural) and read "
            "its label heatmap",
            "measure label skew with EMD and JS, and see FedAvg's accuracy fall as α falls, over several seeds"),
           "Python, NumPy, a first PyTorch training loop (SGD, cross-entropy)"),
    Lesson("heterogeneity", "Algorithms for heterogeneous clients",
           ("baselines", "moon_feddyn", "fedbn", "natural_partitions", "fedld", "fedftg"),
           ("basics",),
           ("explain client drift and what FedProx's proximal term, SCAFFOLD's control variates, FedNova's "
            "normalisation and FedAdam's server optimiser each change",
            "compare MOON's contrastive loss and FedDyn's dynamic regulariser with them under Dirichlet(0.1)",
            "see feature shift as non-IID data too, and why FedBN's local BatchNorm statistics absorb it",
            "split the global loss exactly into local, distribution-shift and aggregation terms for any models, "
            "and see that lowering one (a margin penalty, a principal-gradient aggregation) can be paid back in "
            "another (FedLD)",
            "improve the averaged model on a server with no data: train a generator whose samples the client "
            "models agree on and distil their class-weighted ensemble, and name what it costs in privacy (the "
            "clients' label histograms) and server compute (FedFTG)"),
           "gradient descent with momentum and Adam; BatchNorm"),
    Lesson("weights", "Aggregation weights and participation",
           ("fedau", "afl", "feddisco", "ida", "ldawa", "fedlaw", "fedgp", "fedce", "aggregation_weights"),
           ("basics",),
           ("see why averaging whoever shows up biases FedAvg, and how FedAU's participation intervals remove it",
            "derive a closed-form (analytic) federated solution whose aggregate does not depend on the split",
            "weight clients by how far their label distribution is from the global one (FedDisco), by their "
            "distance to the mean model (IDA) and layer by layer by their angle to the global model (L-DAWA)",
            "learn a global shrinking factor and the relative weights on a server proxy set (FedLAW), and read "
            "it as a small bilevel problem",
            "adapt to a target domain by projecting source updates onto the target's direction (FedGP), and "
            "compare every weighting on one task",
            "score each client's contribution by its update's angle to the others' and by how the leave-one-out "
            "model does on its data, and weigh clients by it for a fairer worst client (FedCE)"),
           "least squares / ridge regression; expectations of random sampling"),
    Lesson("robustness", "Byzantine clients and robust aggregation",
           ("robust_aggregation", "gas", "centered_clipping", "flag_aggregator", "frl", "backdoors", "fedcpa", "flip"),
           ("basics", "heterogeneity"),
           ("run every robust rule (median, trimmed mean, Krum, Bulyan, geometric median, clipping) against "
            "six attacks, IID and non-IID",
            "explain why non-IID data breaks robust rules and how gradient splitting (GAS) and worker momentum help",
            "compare subspace aggregation (flag median) and rank voting (FRL) with the classical rules",
            "replace the global model in one round with a boosted backdoored update (model replacement), and see "
            "norm clipping and the robust rules stop it",
            "plant a backdoor through poisoned client data, measure its attack success rate, and defend by "
            "comparing clients' critical parameters (FedCPA) or by hardening benign clients with inverted "
            "triggers (FLIP)"),
           "medians and norms in high dimension"),
    Lesson("privacy", "Privacy: what leaks, and what protects",
           ("gradient_inversion", "cpa", "dp_fedavg", "secure_aggregation", "cpda", "aggregate_responses", "fedsvd"),
           ("basics",),
           ("reconstruct a client's images from its gradient (DLG, iDLG, Inverting Gradients) and from an "
            "aggregated gradient (CPA, as blind source separation)",
            "clip and noise client updates for user-level differential privacy and account for (ε, δ) with "
            "RDP / PLD accountants",
            "hide individual updates with secure aggregation (masks, Shamir shares, dropouts) and polynomial shares "
            "(CPDA), and learn from aggregate responses only",
            "fine-tune with LoRA under DP-SGD (FedSVD) and measure what privacy costs in accuracy"),
           "probability (Gaussian noise, tails); modular arithmetic for the cryptographic notebooks"),
    Lesson("communication", "Communication, one-shot aggregation and real federations",
           ("compression", "ferret", "fedpara", "fedsa_lora", "fisher_merging", "knn_vote",
            "hierarchical_aggregation", "communication", "flower"), ("basics",),
           ("measure bytes from the encoded messages and trade them against accuracy: sparsification, "
            "quantisation and signs with error feedback, low rank, shared-randomness projections (Ferret), "
            "low-rank Hadamard layers (FedPara) and LoRA factors kept local (FedSA-LoRA)",
            "aggregate in one shot (Fisher merging, a 1-NN majority vote) and along a tree of aggregators",
            "run any fedlab_nb method as a Flower ServerApp / ClientApp, in simulation and on a SuperLink with "
            "SuperNodes, and check it matches the in-process run"),
           "bits and bytes; low-rank matrices; processes and ports; a terminal"),
    Lesson("personalisation", "Personalised federated learning",
           ("personalisation_baselines", "personalisation_more", "clustered_fl", "apfl", "self_fl", "pgfed",
            "fedselect", "inco", "fedloge", "fot", "ggeur", "fed_pub"), ("basics", "heterogeneity"),
           ("evaluate every client's own model on its own test split, next to the global model (one honest "
            "protocol)",
            "compare fine-tuning, shared bodies with local heads (FedPer, FedRep, FedBABU, LG-FedAvg), regularised "
            "personal models (Ditto, pFedMe) and meta-learning (Per-FedAvg)",
            "recover hidden client groups with IFCA and CFL, and when clustering beats one global model",
            "mix a local and the global model with a learned weight (APFL) and shrink local estimates towards the "
            "global one by their uncertainty, exactly on a Gaussian model first (Self-FL)",
            "personalise each client's global objective with a first-order picture of the others' risks (PGFed) "
            "and choose which parameters to personalise by how much they move (FedSelect)",
            "train clients of different depths together and use shallow-layer gradients for the deep layers (InCo)",
            "learn under long-tailed data with a fixed ETF classifier and local and generic heads (FedLoGe)",
            "learn a sequence of tasks without forgetting by projecting updates away from old tasks' activation "
            "subspaces (FOT)",
            "pool per-class covariances from client statistics exactly and augment embeddings along them under "
            "label and domain skew (GGEUR)",
            "find which clients hold similar data from their weights alone, by feeding every client's graph network "
            "the same random graph and comparing outputs, and give each client its own similarity-weighted average "
            "(FED-PUB)"),
           "train / validation / test splits; transfer learning"),
    Lesson("bilevel", "Bilevel federated optimisation",
           ("hypergradients", "pbgd", "warm_cold_start", "fedmbo", "dsbo"), ("personalisation",),
           ("see personalisation as a bilevel problem: pFedMe's Moreau envelope and Per-FedAvg's MAML step "
            "(lesson 'personalisation') are its first examples",
            "compute hypergradients three ways — unrolled, truncated back-propagation, implicit (CG, Neumann) — "
            "and check each against a closed form in float64",
            "replace the bilevel problem by a penalty (PBGD) and measure its O(1/γ) gap; see warm and cold starts "
            "reach different solutions of an under-determined inner problem",
            "estimate a federated hypergradient without bias under non-IID clients, and measure a linear speedup "
            "in the clients per round as a slope (FedMBO)",
            "solve a bilevel problem on a graph without a server, with gossip and Hessian-vector products only, "
            "and measure why that scales linearly in the inner dimension (DSBO)"),
           "implicit differentiation; hypergradients"),
    Lesson("more", "Fairness, incentives, adversarial training and decentralised learning",
           ("aglfop", "fal", "dp_robust", "fair_bfl", "vra_dgt"),
           ("basics", "robustness", "privacy"),
           ("add DP noise and Byzantine workers together and see a top-eigenvalue rule (SMEA) pay only a constant "
            "factor of the unavoidable DP error, where trace-driven rules pay a factor growing with n "
            "(the privacy-robustness-utility trilemma)",
            "make adversarial training a client-side change of FedAvg (PGD examples of each local batch), and "
            "measure robust accuracy gained against clean accuracy lost (FAL)",
            "score clients from their updates, split a fixed reward budget by the score, compare it with exact "
            "Shapley values, and keep the history in a hash-chained ledger (a FAIR-BFL-style contribution rule)",
            "audit a federated model's global and local group fairness with a partial information decomposition, "
            "and see why local fairness implies global fairness only when the sensitive attribute is independent "
            "of the client (AGLFOP)",
            "see why gradient tracking works (the tracking variables always sum to the gradients), how a noisy link "
            "turns that sum's error into a random walk, and why damping alone does not restore the rate "
            "(gradient tracking with inexact communication)",),
           "convex optimisation; random walks"),
    Lesson("labels", "Scarce labels, unseen classes, new domains and mixed hardware",
           ("fedlabel", "fedossl", "fedka", "fedins", "prowd"),
           ("basics", "heterogeneity", "personalisation"),
           ("keep a private local model next to the global one and pseudo-label unlabelled data with the more "
            "confident of the two, checked exactly against FedAvg and audited against the hidden labels, and see "
            "why over-confident local models make the selection fail at toy scale (FedLabel)",
            "score classes no client has labels for by Hungarian matching, ask whether a class held by one client "
            "is found worse than classes held by two, and see what a suppressed loss and a server centroid "
            "calibration each change, alone and together (FedoSSL)",
            "build and check an unbiased MMD estimator, align clients to an unlabelled target domain by broadcasting "
            "only feature embeddings and voting on pseudo-labels, and see why consensus labels from weak clients do "
            "not help at toy scale (FedKA)",
            "turn scale-and-shift tuning (γ ⊙ h + β on a frozen backbone) into a federated method that uploads a few "
            "per-feature vectors, route each instance to its own entries of a key pool, and check exactly that it "
            "reduces to federated SSF and whether the routing follows the domains or collapses (FedIns)",
            "quantise weights uniformly to b bits with a straight-through estimator, and see why averaging 2-bit "
            "devices' weights with full-precision models hurts the full-precision devices most (ProWD; the "
            "dequantiser is our simplification)"),
           "semi-supervised learning (pseudo-labels, consistency)"),
    Lesson("beyond", "Aggregation beyond federated training",
           ("wise_ft", "dca", "wakd", "pareto_manifold", "pcb_merging", "evolutionary_merge", "hdee", "run_off_election", "hash_bagging", "jacobian_descent", "moe_reduction",
            "smc_fusion", "locational_dp"),
           ("basics", "robustness", "privacy", "communication"),
           ("interpolate a pretrained and a fine-tuned model's weights (WiSE-FT), count the inputs both get wrong and "
            "their mix gets right, and test MixUp with label smoothing as the balancing fix (BANG)",
            "see why independently trained networks cannot be averaged while layer copies trained in random "
            "combinations can, and compare their average (DCWA) with SWA and a deep ensemble (DCA)",
            "average one model's weights over time (a running mean, SWAD's validation window, SMA) under knowledge "
            "distillation, and test whether it helps on unseen domains (WAKD)",
            "train one weight member per task on random mixtures to get a whole trade-off line from one run, and "
            "check when a Pareto set is a straight line (Pareto manifold learning)",
            "give every task-vector coordinate its own coefficient from importance and agreement (PCB-Merging), "
            "and compare it with task arithmetic, TIES and the Fisher merge under one tuning budget",
            "search per-layer merge weights with CMA-ES from one-shot FedAvg and task arithmetic, and watch a "
            "validation-only guarantee turn into overfitting (evolutionary merging)",
            "aggregate mixture models from local fits by matching components instead of averaging them, and see "
            "why exchangeable components break FedAvg-style averaging (MoE reduction)",
            "combine parties' sub-posteriors as a product, see Gaussian and consensus rules fail on skewed ones "
            "and flat importance sampling collapse, and fuse up a tree instead (an SMC Fusion analogue)",
            "combine domain experts in output space with a per-token posterior that is never worse than the best "
            "expert by more than log E, and weigh heterogeneous expert sizes at equal compute (HDEE)",
            "turn a hash-partition ensemble into a certificate against data poisoning, and improve it with a "
            "run-off between the top two classes (ROE)",
            "certify a whole test set at once against one poisoned training set with an integer program, and see "
            "hash bagging beat random subsets (collective certification)",
            "aggregate client gradients by projecting each onto the cone that hurts no client (UPGrad), and see the "
            "same guarantee let one Byzantine client freeze training (Jacobian descent)",
            "aggregate regional statistics under local DP without bias, with a variance formula checked by "
            "simulation, and compare local with central DP (locational DP)"),
           "probability; linear programming; the FL chapters' aggregation rules"),
)


def lesson_of(paper_id: str) -> Lesson:
    """The lesson a paper belongs to; CourseError when the course does not place it yet."""
    for lesson in LESSONS:
        if paper_id in lesson.papers:
            return lesson
    raise CourseError(f"papers/{paper_id}.yaml is not in the course: add {paper_id!r} to one lesson's papers in "
                      "LESSONS (fedlab_nb/repro/course.py), then run scripts/make_course.py")


def check_lessons(lessons=LESSONS) -> None:
    """Each paper in one lesson only, prerequisites name earlier lessons."""
    seen, keys = {}, []
    for lesson in lessons:
        for p in lesson.papers:
            if p in seen:
                raise CourseError(f"paper {p!r} is in lessons {seen[p]!r} and {lesson.key!r}; give it one lesson")
            seen[p] = lesson.key
        late = [k for k in lesson.prerequisites if k not in keys]
        if late:
            raise CourseError(f"lesson {lesson.key!r} lists prerequisites {late} that are not earlier lessons")
        keys.append(lesson.key)


# ---------------------------------------------------------------------------------------------- check_exercise
def _strict() -> bool:
    mode = os.environ.get(EXERCISES_ENV, "").strip().lower()
    if mode in ("strict", "lenient"):
        return mode == "strict"
    return bool(os.environ.get(RUN_DIR_ENV))   # executed by nbval / fedlab-nb: a wrong solution fails the run


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return repr(value)


def _split_leading_name(expectation: str, named: dict):
    """'gap > 0.03' with gap=... -> ('> 0.03', 'gap'); otherwise (expectation, None)."""
    m = re.match(r"\s*([A-Za-z_]\w*)\s+(.*)$", expectation, re.S)
    if m and m.group(1) in named and m.group(1) not in ("within", "between"):
        return m.group(2), m.group(1)
    return expectation, None


def _parse(expectation):
    try:
        return parse_expectation(expectation)
    except ExpectationError as e:
        raise ExpectationError(f"check_exercise: bad expectation {expectation!r}: {e}. "
                               f"An expectation is {GRAMMAR}") from None


def _not_answered(value) -> bool:
    return value is None or value is Ellipsis


def _scalar_hint(expect, value, refs) -> str:
    """How far the value is from passing, in words."""
    from .expect import _value
    try:
        if expect.kind in ("<", "<=", ">", ">="):
            bound = _value(expect.args[0], refs)
            side = "larger" if expect.kind.startswith(">") else "smaller"
            return f"it must be {side} than {_fmt(bound)}; it is off by {_fmt(abs(value - bound))}"
        if expect.kind == "==":
            return f"it must equal {_fmt(_value(expect.args[0], refs))}"
        if expect.kind == "between":
            low, high = (_value(a, refs) for a in expect.args)
            return f"it must lie in [{_fmt(low)}, {_fmt(high)}]"
        tol, relative, target = expect.args
        x = _value(target, refs)
        allowed = tol * abs(x) if relative else tol
        return f"it is {_fmt(abs(value - x))} away from {_fmt(x)}; at most {_fmt(allowed)} is allowed"
    except TypeError:
        return "compare a number with a number (or a bool / string with ==)"


def _refs_text(expect, refs) -> str:
    shown = [f"{n} = {_fmt(refs[n])}" for n in sorted(expect.names)]
    return f" with {', '.join(shown)}" if shown else ""


def check_exercise(expectation: str, value=None, *, hint: str | None = None, seeds: int | None = None,
                   **named) -> bool:
    """Grade a student's number against an expectation of the claims grammar; prints one line and returns
    True (PASS) or False (TRY AGAIN). `named` gives the names used in the expectation (`hint` and `seeds` are
    reserved: an extra sentence shown on TRY AGAIN; the number of seeds of a paired answer). A list / array of
    values is judged like a seeded claim. With `seeds=N` the answer must be N values, one per seed (paired by
    seed): a single number, such as a difference of means, is refused with TRY AGAIN."""
    if not isinstance(expectation, str):
        raise ExpectationError(f"check_exercise: the expectation must be a string such as '> 0.9', got "
                               f"{expectation!r}. An expectation is {GRAMMAR}")
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 2):
        raise ValueError(f"check_exercise: seeds= is the number of seeds of a paired answer, an int >= 2 "
                         f"(e.g. seeds=len(acc)); got {seeds!r}")
    text, lhs = (expectation, None) if value is not None else _split_leading_name(expectation, named)
    if value is None and lhs is None:
        raise ValueError(f"check_exercise({expectation!r}) has no value to check: pass it second "
                         f"(check_exercise('> 0.9', acc)) or name it on the left ('acc > 0.9', acc=acc)")
    if lhs is not None:
        value = named[lhs]
    expect = _parse(text)
    missing = sorted(n for n in expect.names if n not in named)
    if missing:
        raise ValueError(f"check_exercise({expectation!r}) uses {', '.join(missing)} but got no value for it: "
                         f"pass it as a keyword, e.g. check_exercise({expectation!r}, value, {missing[0]}=...)")
    label = lhs or "your answer"
    if _not_answered(value) or any(_not_answered(v) for v in named.values()):
        return _report(False, f"{label} {expect.text}", "no answer yet: fill in the cell above and run it again",
                       hint)
    shown = _fmt(float(value)) if isinstance(value, float) else None  # NaN stays visible as nan
    try:
        value = to_json_value(value, label)
        refs = {n: to_json_value(v, n) for n, v in named.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"check_exercise: {e}") from None
    if seeds is not None and not (isinstance(value, list) and len(value) == seeds):
        got = f"{len(value)} values" if isinstance(value, list) else f"one number ({_fmt(value)})"
        return _report(False, f"{label} {expect.text}", f"a paired answer is one value per seed, {seeds} values; "
                       f"got {got}: compute the difference within each seed, not between means", hint)
    if isinstance(value, list):
        return _check_seeds(expect, label, value, refs, hint)
    try:
        ok = expect.holds(value, refs)
    except MetricError as e:
        return _report(False, f"{label} {expect.text}", f"got {shown or _fmt(value)}: {e}", hint)
    head = f"{label} {expect.text}{_refs_text(expect, refs)}"
    if ok:
        return _report(True, f"{head} (got {_fmt(value)})", None, None)
    return _report(False, head, f"got {_fmt(value)}, expected {expect.text}: {_scalar_hint(expect, value, refs)}",
                   hint)


def _check_seeds(expect, label, values, refs, hint) -> bool:
    import numpy as np

    from .verdicts import DEFAULT_CONFIDENCE, REPRODUCED, mean_interval, seeded_verdict
    if len(values) < 2 or any(v is None for v in values):
        return _report(False, f"{label} {expect.text}", "a per-seed answer needs at least 2 finite values", hint)
    try:
        verdict = seeded_verdict(expect, np.asarray(values, float), refs, DEFAULT_CONFIDENCE)
    except MetricError as e:
        return _report(False, f"{label} {expect.text}", str(e), hint)
    spread = mean_interval(values).text()
    head = f"{label} {expect.text}{_refs_text(expect, refs)} over {len(values)} seeds"
    if verdict == REPRODUCED:
        return _report(True, f"{head} (got {spread})", None, None)
    return _report(False, head, f"got {spread}, expected {expect.text} for the whole interval ({verdict})", hint)


def _report(ok: bool, head: str, why: str | None, hint: str | None) -> bool:
    if ok:
        print(f"PASS: {head}")
        return True
    line = f"TRY AGAIN: {head} ({why})" + (f" Hint: {hint}" if hint else "")
    print(line)
    if _strict():
        raise ExerciseFailed(line)
    return False


# ---------------------------------------------------------------------------------------------- student version
def is_solution(cell) -> bool:
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def stub_source(source: str) -> str:
    """A stub for a solution cell: every name the solution assigns at top level gets `...`, functions keep
    their signature with a `...` body, so the check cell after it runs and says 'no answer yet'."""
    lines = [STUB_LINE]
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.append(f"def {node.name}({ast.unparse(node.args)}):")
            lines.append("    ...")
        for name in _assigned_names(node):
            lines.append(f"{name} = ...")
    if len(lines) == 1:
        lines.append("...")
    return "\n".join(dict.fromkeys(lines))  # a name assigned twice is stubbed once


def _assigned_names(node) -> list[str]:
    targets = {ast.Assign: lambda n: n.targets, ast.AnnAssign: lambda n: [n.target],
               ast.AugAssign: lambda n: [n.target]}.get(type(node), lambda n: [])(node)
    names = []
    for t in targets:
        names += [e.id for e in ast.walk(t) if isinstance(e, ast.Name)]
    return names


def _calls_check_exercise(source: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "check_exercise"
               for n in ast.walk(tree))


def exercise_cells(nb, name: str = "the notebook") -> list[tuple[int, int]]:
    """(answer cell, check cell) indices of each self-graded exercise: a code cell tagged `solution` (in a
    student version: `student-stub`) and the code cell right after it, which calls check_exercise. CourseError
    when an answer cell has no check cell."""
    pairs = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not (is_solution(cell) or STUB_TAG in cell.metadata.get("tags", [])):
            continue
        after = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
        if after is None or after.cell_type != "code" or not _calls_check_exercise(after.source):
            raise CourseError(f"{name}: the solution cell {i} is not followed by a check cell: put a code cell "
                              "calling repro.check_exercise(...) right after it")
        pairs.append((i, i + 1))
    return pairs


def _without_written_answers(nb):
    """A copy without the markdown cells tagged `solution` (written-out answers: the instructor's only)."""
    out = copy.deepcopy(nb)
    out.cells = [c for c in out.cells if c.cell_type == "code" or not is_solution(c)]
    return out


def _mark_for_nbgrader(nb) -> None:
    """nbgrader cell metadata (schema 3): each answer cell a solution cell, each check cell an autograded test
    worth 1 point (read-only: the autograder puts its own copy back), every other cell read-only."""
    pairs = exercise_cells(nb)
    answers = {a: k for k, (a, _) in enumerate(pairs, 1)}
    checks = {c: k for k, (_, c) in enumerate(pairs, 1)}
    for i, cell in enumerate(nb.cells):
        md = {"schema_version": 3, "solution": i in answers, "grade": i in checks, "locked": i not in answers}
        if i in answers:
            md["grade_id"] = f"exercise_{answers[i]}_answer"
        elif i in checks:
            md.update(grade_id=f"exercise_{checks[i]}", points=1)
        else:
            md["grade_id"] = f"cell_{i}"
        cell.metadata["nbgrader"] = md


def student_notebook(nb):
    """A copy of the notebook for students: solution code cells become stubs (outputs cleared), markdown cells
    tagged `solution` are removed, and the cells carry nbgrader's metadata (what the autograder grades).
    The notebook passed in is not changed."""
    out = _without_written_answers(nb)
    _mark_for_nbgrader(out)
    for cell in out.cells:
        if is_solution(cell):
            tags = [t for t in cell.metadata.get("tags", []) if t != SOLUTION_TAG] + [STUB_TAG]
            cell.metadata["tags"] = tags
            cell.source, cell.outputs, cell.execution_count = stub_source(cell.source), [], None
    out.metadata["fedlab_nb_course"] = {"version": "student"}
    return out


def autograder_notebook(nb):
    """The autograder's source notebook (nbgrader's source/<assignment>/): the master with its solutions, the
    cells marked for nbgrader as in the student version, outputs cleared. The notebook passed in is not changed."""
    out = _without_written_answers(nb)
    _mark_for_nbgrader(out)
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    out.metadata["fedlab_nb_course"] = {"version": "autograder"}
    return out


def exercises_of(nb) -> dict:
    """{'listed': titles of the numbered exercises in the Exercises section, 'graded': titles of the
    self-graded ones (the bold start of the markdown cell before each solution cell)}."""
    listed, graded = [], []
    cells = nb.cells
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown" and re.search(r"^#+ .*Exercises", cell.source, re.M):
            section = re.split(r"^#+ ", cell.source.split("Exercises", 1)[1], maxsplit=1, flags=re.M)[0]
            listed += [_title(m) for m in re.findall(r"^\d+\.\s+(.*)$", section, re.M)]
        if is_solution(cell) and cell.cell_type == "code" and i and cells[i - 1].cell_type == "markdown":
            graded.append(_title(cells[i - 1].source))
    return {"listed": listed, "graded": graded}


def _title(text: str) -> str:
    """The bold lead of an exercise ('**Local work.** ...' -> 'Local work'), else its first sentence or clause."""
    m = re.search(r"^\*\*(.+?)\*\*", text, re.M)  # a paragraph that starts in bold
    title = m.group(1) if m else re.split(r"(?<=[.?!])\s|:\s", text.strip(), maxsplit=1)[0]
    title = re.sub(r"\s+", " ", title.replace("**", "")).strip().rstrip(".:")
    if len(title) > 60 and " (" in title[15:]:
        title = title[:title.index(" (", 15)]          # drop a long parenthesis
    if len(title) > 80:
        title = title[:title.rfind(" ", 0, 77)] + " …"
    if title.count("`") % 2:
        title = title[:title.rfind("`")].rstrip() + " …"  # never leave an inline code span open
    return title


# ---------------------------------------------------------------------------------------------- syllabus
def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def build_syllabus(root=None) -> str:
    """The syllabus as markdown: lessons in order, each with prerequisites, goals, time at smoke scale (sum of
    the claims files' `scales.smoke.seconds`) and its notebooks with their exercises. Only papers whose claims
    file exists are listed; a claims file that no lesson places raises CourseError."""
    import nbformat
    from .claims import default_root, load_paper, paper_ids
    root = Path(root or default_root())
    check_lessons()
    present = paper_ids(root)
    for pid in present:
        lesson_of(pid)
    titles = {lesson.key: f"{i}. {lesson.title}" for i, lesson in enumerate(LESSONS, 1)}
    out = ["# Syllabus", "",
           "Generated by `scripts/make_course.py` from `papers/*.yaml`, the notebooks' exercise sections and the "
           "lesson table in `fedlab_nb/repro/course.py`; do not edit by hand. Times are the claims files' "
           "smoke-scale seconds (one notebook top to bottom on one CPU core). Self-graded exercises print PASS / "
           "TRY AGAIN (`repro.check_exercise`); the teacher's page is `docs/teachers.md`.", "",
           "| lesson | notebooks | time at smoke scale | prerequisites |", "|---|---|---|---|"]
    rows, sections = [], []
    for lesson in LESSONS:
        papers = [load_paper(p, root) for p in lesson.papers if p in present]
        seconds = sum(p.scales["smoke"].get("seconds") or 0 for p in papers)
        prereq = ", ".join(titles[k] for k in lesson.prerequisites) or "none"
        names = ", ".join(f"`{Path(p.notebook).stem}`" for p in papers) or "none yet"
        rows.append(f"| {titles[lesson.key]} | {names} | {_minutes(seconds) if papers else '—'} | {prereq} |")
        sections += ["", f"## {titles[lesson.key]}", "",
                     f"*Prerequisites:* {prereq}" + (f"; from outside the course: {lesson.background}."
                                                     if lesson.background else "."),
                     f"*Time at smoke scale:* {_minutes(seconds) if papers else 'no notebook yet'}"
                     + (f" ({len(papers)} notebooks)" if len(papers) > 1 else "") + ".", "",
                     "You will be able to:", ""]
        sections += [f"- {g}" for g in lesson.goals]
        for p in papers:
            path = root / p.notebook
            sections += ["", *_paper_section(p, nbformat.read(path, as_version=4) if path.is_file() else None)]
        if not papers:
            sections += ["", "No notebook in this lesson yet."]
    return "\n".join(out + rows + sections) + "\n"


def _paper_section(paper, nb) -> list[str]:
    ref = paper.paper
    authors = ref["authors"] if len(ref["authors"]) <= 70 else ref["authors"].split(",")[0] + " et al."
    smoke = paper.scales["smoke"].get("seconds")
    lines = [f"### `{paper.notebook}` · {paper.method}", "",
             f"{authors}, *{ref['title']}*, {ref['venue']} {ref['year']}"
             + (f" ([link]({ref['url']}))" if ref.get("url") else "") + ".",
             f"Smoke scale: {_minutes(smoke) if smoke else 'not measured'}; {len(paper.claims)} claims "
             f"(`papers/{paper.id}.yaml`)."]
    if nb is None:
        return lines + ["The notebook is not written yet."]
    ex = exercises_of(nb)
    if ex["graded"]:
        lines.append("Self-graded: " + "; ".join(ex["graded"]) + ".")
    if ex["listed"]:
        lines.append("Exercises: " + "; ".join(ex["listed"]) + ".")
    return lines


# ---------------------------------------------------------------------------------------------- writing it all
def _folders(base: Path, *parts: str) -> Path:
    """base/part1/part2/... made one level at a time, each refused when it is a link (make_folder checks only
    the last component, so a link at results/course would otherwise be written through)."""
    from .files import make_folder
    path = make_folder(base)
    for part in parts:
        path = make_folder(path / part)
    return path


def _notebook_text(nb) -> str:
    """The text nbformat.write puts in a file (it ends with a newline)."""
    import nbformat
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def write_course(root=None, out=None, syllabus=None) -> dict:
    """Write the syllabus (default docs/syllabus.md) and, for every notebook in notebooks/, the student version
    (<out>/student/<nb>.ipynb), an unchanged copy (<out>/instructor/<nb>.ipynb) and, for a notebook with
    self-graded exercises, the autograder's source (<out>/autograder/source/<stem>/<nb>.ipynb, nbgrader's
    layout; scripts/grade.py grades submissions against it). out defaults to results/course; notebooks/ is only
    read. Returns {'syllabus': path, 'student': [...], 'instructor': [...], 'autograder': [...]}."""
    import nbformat
    from .claims import default_root
    from .files import write_atomic
    root = Path(root or default_root())
    out = Path(out) if out else root / "results" / "course"
    syllabus = Path(syllabus) if syllabus else root / "docs" / "syllabus.md"
    syllabus.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(syllabus, build_syllabus(root))  # never through a link (write_atomic refuses one)
    written = {"syllabus": syllabus, "student": [], "instructor": [], "autograder": []}
    for kind in ("student", "instructor"):
        _folders(out, kind)
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        exercise_cells(nb, str(path))             # an answer cell without its check cell is an error here
        written["student"].append(write_atomic(out / "student" / path.name, _notebook_text(student_notebook(nb))))
        written["instructor"].append(write_atomic(out / "instructor" / path.name, path.read_bytes()))
        if any(is_solution(c) for c in nb.cells):
            target = _folders(out, "autograder", "source", path.stem) / path.name
            written["autograder"].append(write_atomic(target, _notebook_text(autograder_notebook(nb))))
    return written


__all__ = ["check_exercise", "ExerciseFailed", "CourseError", "LESSONS", "Lesson", "lesson_of", "build_syllabus",
           "student_notebook", "autograder_notebook", "exercise_cells", "stub_source", "exercises_of", "write_course",
           "GRAMMAR"]
