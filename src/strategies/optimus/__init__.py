"""Optimus (Feng et al.): encoder work scheduled into the LLM pipeline's bubbles, its encoder
layouts, timeline, bubble scheduler and Programs (planner.py is the entry)."""
