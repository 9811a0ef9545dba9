"""The Llama family as a stateless layer template, and Hugging Face import/export."""
