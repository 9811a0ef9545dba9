"""What a run writes: checkpoints, the model's weights, Hugging Face's output files, TensorBoard's events, the step
line and log, output_dir's lock, and a resume's notes."""
