"""kvgate deploy."""
