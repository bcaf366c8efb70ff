"""The step (loss, gradients, optimizer), its wrapper (`guard`, `guarded_step`, `faults`,
`rollback`, `loop_state`), the training loop and the train state."""
