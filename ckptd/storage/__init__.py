"""The mechanisms every tier writes through: durable writes, the commit protocol, and object stores."""
