"""kvgate agents."""
