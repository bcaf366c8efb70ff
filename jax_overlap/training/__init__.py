"""The step (loss, gradients, optimizer), the training loop, data and the train state."""
