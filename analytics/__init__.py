"""kvgate analytics."""
