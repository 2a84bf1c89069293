"""Virtual-time simulation of a cluster of engines behind kvgate's routing core."""
