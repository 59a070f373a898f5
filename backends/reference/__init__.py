"""Plain torch implementations: the yardstick every other backend is compared with."""
