"""Data preparation: sources, chat-template loss masks, and the prepared-data format."""
