"""Drill L8's page checks: every number content/l8.md works out, recomputed."""
PAGE_CHECKS = ()
