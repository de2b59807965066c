"""Drill L7's page checks: every number content/l7.md works out, recomputed (PAGE_CHECKS,
in the order the grade runs them). Filled in as the page grows."""

PAGE_CHECKS = ()
