"""kvgate admission."""
