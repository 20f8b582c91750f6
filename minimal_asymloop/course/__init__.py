"""What the notebooks import so that their cells show the idea, not the plumbing: one module per notebook for its
figures and tables (as LLMs-from-scratch's previous_chapters.py), and draw.py for the mechanism drawn once."""
