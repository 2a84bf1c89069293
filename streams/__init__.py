"""kvgate streams."""
