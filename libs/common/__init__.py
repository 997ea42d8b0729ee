"""Messages shared by several services (generated stubs under v1/)."""
