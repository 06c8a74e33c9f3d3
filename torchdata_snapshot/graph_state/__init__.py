"""Graph state: resumable DataPipes and readers, their captured states and how they are loaded."""
