"""Links: the outbound link table, inbound links from peers, their authentication, and the notifications peers
send over them."""
