"""Many replies and busy hosts: replies on disk, alignment workers (processes or Ray), replies read as they
arrive, the allocator and the count of free cores."""
