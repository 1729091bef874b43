"""Reproduction harness: record metrics in notebooks, check claims, run notebooks, build the report.

Inside a notebook:   from fedlab_nb import repro
                     repro.record("final_acc", acc); repro.save_figure(fig); repro.check_claims("fedau")
From Python / CLI:   repro.reproduce("fedau", "smoke"); repro.build_report("results")
"""
from .claims import (ERROR, INCONCLUSIVE, NOT_REPRODUCED, PARTIAL, REPRODUCED, ClaimsFileError, ReproError,
                     UnknownPaperError, check_claims, claim_verdicts, headline, judge_detail, load_claims, load_paper,
                     paper_ids, show_intervals)
from .expect import ExpectationError, parse_expectation
from .figures import save_figure
from .recording import record, recorded

_LAZY = {  # papermill-based pieces load on first use, so `import repro` stays cheap inside a kernel
    "run_notebook": "runner", "reproduce": "runner", "mismatches": "runner", "ParameterError": "runner",
    "build_report": "report",
    "check_exercise": "course",  # the course's self-grading exercises (PASS / TRY AGAIN)
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["record", "recorded", "save_figure", "check_claims", "headline", "claim_verdicts", "judge_detail", "show_intervals",
           "load_claims", "load_paper", "paper_ids",
           "parse_expectation", "ClaimsFileError", "ExpectationError", "ReproError", "UnknownPaperError",
           "REPRODUCED", "PARTIAL", "NOT_REPRODUCED", "INCONCLUSIVE", "ERROR", *_LAZY]
