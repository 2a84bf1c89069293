"""kvgate router."""
