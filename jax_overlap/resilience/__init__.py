"""Checkpoints, step guards, rollback, fault injection, preemption and the watchdog."""
