"""`tokenmill router`: one OpenAI-compatible front spreading requests over several `tokenmill serve` replicas."""
